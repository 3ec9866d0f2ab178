"""The formats layer: the registry, then one module or subpackage per system.

Each system's format is a `pytreeio.Format` record of pure functions, registered when its
module is imported (`pytreeio.formats.registry` imports a module when a call needs it).
No system imports another.
"""
