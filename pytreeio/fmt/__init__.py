"""The built-in formats, one module each; each registers itself on import.

The registry imports them lazily (see ``pytreeio.registry.BUILTIN_MODULES``).
"""
