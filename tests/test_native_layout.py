"""The ctypes structs handed to the native kernels match the C side's layouts (native.layout_mismatch), and a
class that does not is refused with one logged error, the torch layers running instead."""

from __future__ import annotations

import ctypes
import logging

import pytest

from mars_demo.engine.backends.cpu import native, native_layers
from mars_demo.engine.backends.cpu.backend import CpuBackend
from mars_demo.engine.backends.cpu.paths import convert

from conftest import make_lm

pytestmark = pytest.mark.skipif(native.library("decoder") is None, reason="no C++ compiler: the kernel cannot be built")


def pass_fields(fields: list) -> type[ctypes.Structure]:
    """A ctypes class named like decoder.cpp's Pass, with these fields."""
    return type("_Pass", (ctypes.Structure,), {"_fields_": fields})


SHORT = pass_fields(native_layers._Pass._fields_[:-1])  # attention_threads dropped
SIZES = (
    f"{ctypes.sizeof(SHORT)} bytes in {len(SHORT._fields_)} fields in Python, "
    f"{ctypes.sizeof(native_layers._Pass)} bytes in {len(native_layers._Pass._fields_)} fields in C"
)


def test_every_struct_the_decoder_reads_has_the_layout_its_library_exports():
    loaded = native.library("decoder")
    for name, struct in native_layers.STRUCTS.items():
        assert native.exported_layout(loaded, name) == native.layout(struct)
        assert native.layout_mismatch(loaded, name, struct) is None
    assert native_layers.kernel() is not None


def test_a_removed_field_is_refused():
    wrong = native.layout_mismatch(native.library("decoder"), "Pass", SHORT)
    assert wrong == f"ctypes class _Pass and C struct Pass differ: {SIZES}"


def test_a_reordered_field_is_refused_at_the_first_field_out_of_place():
    fields = list(native_layers._Pass._fields_)
    names = [name for name, _ in fields]
    fields.insert(names.index("cos"), fields.pop(names.index("scale")))  # a float moved ahead of a pointer
    wrong = native.layout_mismatch(native.library("decoder"), "Pass", pass_fields(fields))
    assert wrong is not None and wrong.startswith("ctypes class _Pass and C struct Pass differ at field 7 ('scale')")
    assert "size 4 in Python; offset 56, size 8 in C" in wrong


def test_a_library_without_the_struct_is_refused():
    loaded = native.library("greedy")
    if loaded is None:
        pytest.skip("no greedy kernel")
    assert native.layout_mismatch(loaded, "Pass", native_layers._Pass) == (
        "the library exports no layout for C struct Pass"
    )


def test_a_mismatch_refuses_the_native_layers_with_one_message_and_the_torch_layers_run(monkeypatch, caplog):
    monkeypatch.setitem(native_layers.STRUCTS, "Pass", SHORT)
    native_layers.kernel.cache_clear()
    try:
        with caplog.at_level(logging.ERROR, logger=native.__name__):
            assert native_layers.kernel() is None
            lm = make_lm("llama")
            convert(lm.model, "int8dyn")
            backend = lm.backend  # the CPU engine reads which native layers it has when it is built
    finally:
        monkeypatch.undo()
        native_layers.kernel.cache_clear()
    refused = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and refused[0].levelno == logging.ERROR
    assert refused[0].getMessage() == (
        "native decoder kernel refused, its torch path runs instead: ctypes class _Pass and C struct Pass differ: "
        + SIZES
    )
    assert isinstance(backend, CpuBackend) and not backend.native  # the CPU engine on its torch layers
    assert native_layers.kernel() is not None
