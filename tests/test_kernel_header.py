"""pdflow_kernels.h is the one description of the kernels' interface: ctypes declares every function
from its prototypes, the ctypes Structures have its structs' fields, the library exports what it
declares and nothing else, every C file includes it and none declares another file's function
itself, and the build is keyed by it."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import pytest

from pdflow import kernels
from pdflow.kernels import header

SAMPLE = """
/* a comment with a prototype in it: int pdflow_not_this(int x); */
#include <stdint.h>
typedef struct {
    int64_t n;              /* trailing comment */
    const float *scale;
} sample_struct;
void f_void(void);
int f_many(const float *x, int64_t n, float *const *rows,
           const pdflow_layer *layers, float eps, unsigned char flag);
"""


def test_the_header_reader_normalizes_prototypes_and_structs():
    read = header.read(SAMPLE)
    assert read.structs == {"sample_struct": (("int64_t", "n"), ("float *", "scale"))}
    assert list(read.prototypes) == ["f_void", "f_many"]  # the commented-out one is not read
    assert read.prototypes["f_void"] == ("f_void", "void", ())
    assert read.prototypes["f_many"].result == "int"
    assert [p.type for p in read.prototypes["f_many"].parameters] == [
        "float *", "int64_t", "float **", "pdflow_layer *", "float", "unsigned char"]
    assert [p.name for p in read.prototypes["f_many"].parameters] == ["x", "n", "rows", "layers", "eps", "flag"]


@pytest.mark.parametrize("text", [
    "int f(int);",  # an unnamed parameter
    "int table[3];",  # not a prototype
    "typedef struct { int a, b; } two_at_once;",  # two fields in one declaration
    "int f(int (*callback)(int));",  # a function pointer
])
def test_the_header_reader_refuses_what_it_cannot_read(text):
    with pytest.raises(ValueError):
        header.read(text)


def test_ctypes_types_follow_the_c_types_and_refuse_unknown_ones():
    assert kernels.ctype("float *") is ctypes.c_void_p and kernels.ctype("float **") is ctypes.c_void_p
    assert kernels.ctype("pdflow_layer *") is ctypes.POINTER(kernels.Layer)
    assert kernels.ctype("int64_t") is ctypes.c_int64 and kernels.ctype("float") is ctypes.c_float
    assert kernels.ctype("void") is None
    with pytest.raises(ValueError, match="double"):
        kernels.ctype("double")


def test_every_function_is_declared_as_the_header_has_it():
    lib = kernels.library()
    if lib is None:
        pytest.skip(kernels.unavailable_reason())
    prototypes = header.read().prototypes
    for prototype in prototypes.values():
        function = getattr(lib, prototype.name)
        assert function.argtypes == [kernels.ctype(p.type) for p in prototype.parameters], prototype.name
        assert function.restype == kernels.ctype(prototype.result), prototype.name
    # a few by hand, so that a reader that misread the header everywhere alike would still fail
    assert len(lib.pdflow_decode_layers.argtypes) == 25
    assert lib.pdflow_decode_layers.argtypes[0] is ctypes.POINTER(kernels.Layer)
    assert lib.pdflow_rms_norm.argtypes[4] is ctypes.c_float
    assert lib.pdflow_q4b_gemm.restype is ctypes.c_int and lib.pdflow_q4_gemm.restype is None
    assert lib.pdflow_q4b_paths.argtypes == []


def test_a_build_without_a_declared_function_is_refused_unless_missing_is_allowed():
    libc = ctypes.CDLL(None)  # the process's own symbols: no pdflow_ function among them
    with pytest.raises(RuntimeError, match="no pdflow_"):
        kernels.declare(libc)
    assert kernels.declare(libc, missing_ok=True) is libc


def _ctypes_of(c_type: str):
    return kernels.Matrix if c_type == "pdflow_matrix" else kernels.ctype(c_type)


@pytest.mark.parametrize("structure, name", [(kernels.Matrix, "pdflow_matrix"), (kernels.Layer, "pdflow_layer")])
def test_the_ctypes_structures_have_the_header_structs_fields(structure, name):
    fields = header.read().structs[name]
    assert [field[0] for field in structure._fields_] == [f.name for f in fields]
    assert [field[1] for field in structure._fields_] == [_ctypes_of(f.type) for f in fields]


def test_the_library_exports_exactly_what_the_header_declares():
    lib = kernels.library()
    if lib is None or shutil.which("nm") is None:
        pytest.skip(kernels.unavailable_reason() or "no nm")
    listed = subprocess.run(["nm", "-D", "--defined-only", lib._name], capture_output=True, text=True,
                            check=True).stdout
    exported = {line.split()[-1] for line in listed.splitlines() if " T " in line}
    assert {name for name in exported if name.startswith("pdflow_")} == set(header.read().prototypes)
    assert not {name for name in exported if not name.startswith(("pdflow_", "_"))}  # the rest are static


def test_the_build_lists_every_source_and_header_of_the_package():
    directory = kernels.SOURCES[0].parent
    assert sorted(kernels.SOURCES) == sorted(directory.glob("*.c"))
    assert sorted(kernels.HEADERS) == sorted(directory.glob("*.h"))


def test_every_c_file_includes_the_header_and_declares_no_function_of_another():
    declaration = re.compile(r"^[A-Za-z_][^;{}()]*\b(pdflow_\w+)\s*\([^;{}]*\)[^;{}]*;", re.MULTILINE)
    for source in kernels.SOURCES:
        text = re.sub(r"/\*.*?\*/", "", source.read_text(), flags=re.DOTALL)
        assert '#include "pdflow_kernels.h"' in text, source.name
        assert declaration.findall(text) == [], source.name
    assert declaration.findall("int pdflow_x(int a);\n") == ["pdflow_x"]  # the pattern finds one


def test_every_exported_definition_has_the_headers_prototype_before_it():
    """-Wmissing-prototypes: a non-static function defined without a prototype in scope (the
    header's, since no C file declares one itself) is an error, as is a definition that differs
    from its prototype."""
    compiler = kernels._compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    for source in kernels.SOURCES:
        result = subprocess.run([compiler, "-fsyntax-only", "-march=native", "-fopenmp", "-Wall",
                                 "-Wmissing-prototypes", "-Werror", str(source)], capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr


def test_the_build_key_changes_with_a_header(tmp_path, monkeypatch):
    compiler = kernels._compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    copies = []
    for path in kernels.HEADERS:
        copies.append(tmp_path / path.name)
        copies[-1].write_bytes(path.read_bytes())
    monkeypatch.setattr(kernels, "HEADERS", tuple(copies))
    before = kernels._build_key(compiler)
    copies[1].write_text(copies[1].read_text() + "\n")
    assert kernels._build_key(compiler) != before
