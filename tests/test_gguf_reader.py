"""archc's own GGUF reader (`archc.sources.gguf_reader`) reads what the gguf package writes as
the gguf package's reader does: every metadata value (long arrays too, which it reads only when
asked for) and every tensor's stored bytes; a file cut short is refused naming the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from archc.errors import WeightsError
from archc.sources.gguf_reader import DEFERRED, read_gguf

gguf = pytest.importorskip("gguf", reason="needs gguf (pip install 'archc[gguf]')")

LONG = DEFERRED + 7     # past the length from which an array is read when asked for


def write(path: Path) -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -7)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 1 / 3)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.short", [1, 2, 3])
    w.add_array("t.strings", [f"tok{i}" for i in range(LONG)])
    w.add_array("t.floats", [float(i) / 7 for i in range(LONG)])
    w.add_array("t.empty", [])
    w.add_tensor("a.weight", rng.standard_normal((5, 64)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal((3, 32)).astype(np.float16))
    q8 = gguf.GGMLQuantizationType.Q8_0
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), q8)
    w.add_tensor("c.weight", q, raw_shape=q.shape, raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "all.gguf"
    write(path)
    return path


def read(path: Path):  # noqa: ANN201
    return read_gguf(path, gguf.GGML_QUANT_SIZES, gguf.GGMLQuantizationType)


def test_the_metadata_reads_as_the_gguf_package_reads_it(written: Path) -> None:
    theirs = gguf.GGUFReader(str(written))
    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    fields, _ = read(written)
    assert set(fields) == set(want)
    for key, value in want.items():
        assert fields[key] == pytest.approx(value) if isinstance(value, float) else \
            fields[key] == value, key
    assert fields.size("t.strings") == LONG and fields.size("t.short") == 3
    assert fields.size("t.empty") == 0 and fields.size("not there") == 0
    assert fields["t.strings"] == fields["t.strings"]       # read again, the same


def test_each_tensor_s_stored_values_read_as_the_gguf_package_reads_them(written: Path) -> None:
    theirs = {t.name: t for t in gguf.GGUFReader(str(written)).tensors}
    _, tensors = read(written)
    assert set(tensors) == set(theirs)
    for name, t in theirs.items():
        mine = tensors[name]
        assert (mine.tensor_type, mine.shape, mine.n_bytes) == \
            (t.tensor_type, tuple(int(d) for d in t.shape), int(t.n_bytes)), name
        assert mine.data.dtype == t.data.dtype and np.array_equal(mine.data, t.data), name


@pytest.mark.parametrize("kept, message", [
    (lambda n: n // 100, "ends inside its metadata"),
    (lambda n: n - 100, "tensor 'c.weight' ends past the end of the file"),  # the last one
])
def test_a_file_cut_short_is_refused_naming_it(written: Path, tmp_path: Path, kept: Any,
                                               message: str) -> None:
    cut = tmp_path / "cut.gguf"
    data = written.read_bytes()
    cut.write_bytes(data[:kept(len(data))])
    with pytest.raises(WeightsError, match=f"cut.gguf.*{message}"):
        read(cut)


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "text.gguf"
    path.write_text("hello, not a model")
    with pytest.raises(WeightsError, match="not a readable GGUF file"):
        read(path)
