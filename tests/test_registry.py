"""The registry: built-in formats imported one at a time, in an order no call can change."""

from __future__ import annotations

import subprocess
import sys

import pytreeio as ptio
from pytreeio.formats import registry


def test_the_builtin_table_names_each_formats_module_and_suffixes() -> None:
    formats = ptio.list_formats()
    assert set(registry.BUILTIN) <= set(formats)
    for name, (module, suffixes) in registry.BUILTIN.items():
        # the module named is the one that holds (and so registered) the format record
        assert any(v is formats[name] for v in vars(sys.modules[module]).values()), name
        assert formats[name].suffixes == suffixes, name


def _child(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return out.stdout.strip()


def test_a_named_format_or_suffix_imports_that_format_alone(tmp_path: object) -> None:
    got = _child(
        "import sys, numpy as np, pytreeio as ptio\n"
        f"ptio.save({str(tmp_path)!r} + '/a.msgpack', {{'a': np.ones(2)}})\n"
        f"ptio.load({str(tmp_path)!r} + '/a.msgpack', format='msgpack')\n"
        "print(sorted(m for m in sys.modules if m.startswith('pytreeio.formats.')))"
    )
    assert got == "['pytreeio.formats.msgpack', 'pytreeio.formats.registry']"


def test_sniffing_order_does_not_depend_on_what_was_used_first() -> None:
    first = _child("import pytreeio as ptio; print(list(ptio.list_formats()))")
    after_bullet = _child(
        "import pytreeio as ptio\n"
        "from pytreeio.formats import registry; registry.get('bullet'); registry.get('msgpack')\n"
        "print(list(ptio.list_formats()))"
    )
    assert first == after_bullet == str(list(registry.BUILTIN))


def test_a_builtin_replaced_under_another_name_is_chosen_by_its_suffix() -> None:
    waffe2 = registry.get("waffe2")
    registry.unregister("waffe2")
    try:
        assert registry.for_suffix("a.wf2model") is None
        mine = registry.register(waffe2._replace(name="my-waffe2"))
        assert registry.for_suffix("a.wf2model") is mine
    finally:
        registry.unregister("my-waffe2")
        registry.register(waffe2)
    assert registry.for_suffix("a.wf2model") is waffe2
