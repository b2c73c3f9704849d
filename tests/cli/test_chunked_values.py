"""``stats``, ``diff`` and ``cast`` work on tensors chunk by chunk on worker threads.

``stats`` must give numpy's results (float64, over the finite values) across chunk boundaries,
for chunks with NaN, Inf, zeros, only NaN, or values near the float64 maximum, and the same
digits with one worker or four; ``diff``'s chunks must add up to the comparison of the whole
arrays; ``cast`` must write numpy's bytes and count what overflowed. BF16 is widened by its bits
without ml_dtypes (whose import takes over a second in 0.7): every one of its 65,536 bit
patterns must decode, and cast to F16, F32 and F64, as ml_dtypes does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from pysafetensors import SafetensorError
from pysafetensors._adapter import numpy_dtype
from pysafetensors._cli import _chunk_work
from pysafetensors._cli._cmd_stats import tensor_stats
from pysafetensors._cli._common import open_model
from pysafetensors._dtypes import dtype_from_code
from pysafetensors.numpy import load_file, save_file

#: Elements per chunk in these tests: every tensor below spans several chunks.
CHUNK = 1_000


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_chunk_work, "CHUNK_ELEMENTS", CHUNK)


def _mixed(rng: np.random.Generator, n: int) -> np.ndarray:
    """float64 values whose chunks differ: plain, with NaN and Inf, zeros of both signs, a
    chunk of NaN only, a chunk of one value."""
    values = rng.standard_normal(n) * 3 + 0.5
    values[5] = np.nan
    values[1_500:1_510] = np.inf
    values[1_600] = -np.inf
    values[2_000:2_050] = 0.0
    values[2_050:2_060] = -0.0
    values[3 * CHUNK : 4 * CHUNK] = np.nan  # a chunk with no finite value
    values[5 * CHUNK : 6 * CHUNK] = 7.25  # a chunk of one value
    return values


def _tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    n = 10_500
    mixed = _mixed(rng, n)
    return {
        "f64": mixed,
        "f32": mixed.astype(np.float32),
        "f16": mixed.astype(np.float16),
        "bf16": mixed.astype(ml_dtypes.bfloat16),
        "i64": rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64, endpoint=True),
        "u8": rng.integers(0, 255, n, dtype=np.uint8),
        "c64": (mixed + 1j * rng.standard_normal(n)).astype(np.complex64),
        "bool": rng.integers(0, 2, n).astype(bool),
        "huge": np.concatenate(
            [rng.standard_normal(2_500), rng.uniform(-1, 1, 2_500) * 1.7e308, np.ones(2_500)]
        ),
        "one": np.full(1, 3.0),
        "empty": np.zeros((0, 4), np.float32),
    }


def _expected(array: np.ndarray) -> dict[str, object]:
    values = (
        np.abs(array.astype(np.complex128)).ravel()
        if array.dtype.kind == "c"
        else array.astype(np.float64).ravel()
    )
    finite = values[np.isfinite(values)]
    ints = array.dtype.kind in "iu"
    # numpy's sums of values this large overflow: compare scaled, as the command sums them.
    scale = max(1.0, float(np.abs(finite).max())) if finite.size else 1.0
    return {
        "count": values.size,
        "nan": int(np.isnan(values).sum()),
        "inf": int(np.isinf(values).sum()),
        "zeros": int((values == 0).sum()),
        "min": (int(array.min()) if ints else float(finite.min())) if finite.size else None,
        "max": (int(array.max()) if ints else float(finite.max())) if finite.size else None,
        "mean": float(np.mean(finite / scale) * scale) if finite.size else None,
        "std": float(np.std(finite / scale) * scale) if finite.size else None,
    }


def _stats(cli, path: Path, *args: str) -> dict[str, dict[str, object]]:
    r = cli("stats", path, "--json", *args)
    assert r.code == 0, r.err
    return {t["name"]: t for t in r.json()["tensors"]}


def _run_fresh(*args: str) -> tuple[int, str, bool]:
    """``main(args)`` in a fresh interpreter: its exit code, its stdout, and whether it
    imported ml_dtypes."""
    code = (
        "import sys\n"
        "from pysafetensors._cli import main\n"
        f"code = main({list(args)!r})\n"
        "print(code, 'ml_dtypes' in sys.modules, file=sys.stderr)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    exit_code, imported = r.stderr.strip().splitlines()[-1].split()
    return int(exit_code), r.stdout, imported == "True"


@pytest.mark.usefixtures("small_chunks")
def test_chunked_stats_are_numpys_and_the_same_with_any_number_of_workers(
    cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = _tensors(np.random.default_rng(7))
    path = tmp_path / "mixed.safetensors"
    save_file(tensors, str(path))
    runs = []
    for cores in (1, 2, 4):
        monkeypatch.setattr(_chunk_work, "_usable_cores", lambda cores=cores: cores)
        runs.append(_stats(cli, path, "--histogram", "13"))
    # The chunks are merged in file order whoever summarised them: the same digits.
    assert runs[0] == runs[1] == runs[2]
    got = runs[0]
    for name, array in tensors.items():
        want, row = _expected(array), got[name]
        for key in ("count", "nan", "inf", "zeros", "min", "max"):
            assert row[key] == want[key], (name, key)
        for key in ("mean", "std"):
            if want[key] is None:
                assert row[key] is None, (name, key)
            else:
                assert row[key] == pytest.approx(want[key], rel=1e-12, abs=1e-300), (name, key)
        if want["min"] is not None:
            finite = np.abs(array.astype(np.complex128)) if array.dtype.kind == "c" else array
            finite = finite.astype(np.float64).ravel()
            finite = finite[np.isfinite(finite)]
            edges = np.array(row["histogram"]["edges"])
            assert row["histogram"]["counts"] == np.histogram(finite, bins=edges)[0].tolist()


def test_every_bf16_bit_pattern_widens_as_ml_dtypes_does() -> None:
    bits = np.arange(1 << 16, dtype=np.uint16)
    with np.errstate(invalid="ignore"):  # signalling NaN patterns: a warning, not an error
        values, integers = _chunk_work.as_float64(dtype_from_code("BF16"), bits.view(np.uint8))
        want = bits.view(ml_dtypes.bfloat16).astype(np.float64)
    assert integers is None
    np.testing.assert_array_equal(values, want)  # NaN where NaN, -0.0 and subnormals exact
    assert np.array_equal(np.signbit(values), np.signbit(want))


def test_bf16_stats_do_not_import_ml_dtypes(tmp_path: Path) -> None:
    path = tmp_path / "bf16.safetensors"
    array = (np.arange(-500, 1500) / 7).astype(ml_dtypes.bfloat16)
    save_file({"w": array}, str(path))
    code, out, imported = _run_fresh("-q", "stats", "--json", str(path))
    assert (code, imported) == (0, False)
    (row,) = json.loads(out)["tensors"]
    assert row["mean"] == pytest.approx(float(array.astype(np.float64).mean()), rel=1e-12)
    assert row["min"] == float(array.astype(np.float64).min())


@pytest.mark.usefixtures("small_chunks")
def test_a_file_cut_short_mid_tensor_fails_cleanly_with_workers_running(tmp_path: Path) -> None:
    path = tmp_path / "cut.safetensors"
    save_file({"w": np.random.default_rng(1).standard_normal(50 * CHUNK)}, str(path))
    cut = False

    def progress(_: int) -> None:
        # After the first chunk is merged, the file loses its last half (replaced under the
        # reader): later reads come up short while other chunks are being summarised.
        nonlocal cut
        if not cut:
            cut = True
            os.truncate(path, os.path.getsize(path) // 2)

    with open_model(str(path)) as model:
        (ref,) = model.tensors.values()
        with _chunk_work.ChunkWorkers(3) as workers, pytest.raises(SafetensorError) as err:
            tensor_stats(ref, None, progress, workers)
    assert "ended early" in str(err.value) and "offset" in str(err.value)
    assert not [t for t in threading.enumerate() if t.name.startswith("pysafetensors-chunks")]


def test_workers_hand_back_results_in_order_and_stop_taking_items_on_an_error() -> None:
    taken: list[int] = []

    def items() -> object:
        for i in range(100):
            taken.append(i)
            if i == 20:
                raise ValueError("item 20 is bad")
            yield i

    with _chunk_work.ChunkWorkers(3) as workers:
        results = []
        with pytest.raises(ValueError, match="item 20"):
            for item, doubled in workers.ordered(lambda i: 2 * i, items()):  # type: ignore[arg-type]
                results.append((item, doubled))
    assert results == [(i, 2 * i) for i in range(len(results))]
    assert taken[-1] == 20  # nothing past the failing item was asked for
    # At most two items per worker are ahead of the results taken.
    assert len(results) >= 20 - 2 * 3


def _pairs(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Tensors of A and B whose chunks differ in every way ``diff`` tells apart."""
    n = 10_500
    a = rng.standard_normal(n) * 3
    b = a.copy()
    b[::7] += rng.standard_normal(b[::7].size) * 1e-3  # small changes everywhere
    b[CHUNK : 2 * CHUNK] = a[CHUNK : 2 * CHUNK]  # a chunk of equal values
    b[2 * CHUNK + 5] = -0.0 if a[2 * CHUNK + 5] == 0 else 0.0  # a zero against a value
    a[4 * CHUNK + 1], b[4 * CHUNK + 1] = np.nan, np.nan  # NaN against NaN: equal
    a[4 * CHUNK + 2], b[4 * CHUNK + 2] = np.inf, np.inf
    a[6 * CHUNK + 3], b[6 * CHUNK + 3] = np.inf, 5.0  # beyond any tolerance
    a[8 * CHUNK + 4], b[8 * CHUNK + 4] = 0.0, -0.0  # equal, bytes differ
    a[9 * CHUNK], b[9 * CHUNK] = 1.7e308, -1.7e308  # a difference that overflows
    ints_a = rng.integers(-1000, 1000, n).astype(np.int32)
    ints_b = ints_a.copy()
    ints_b[::11] += 3
    return {
        "f64": (a, b),
        "f32": (a.astype(np.float32), b.astype(np.float32)),
        "bf16": (a.astype(ml_dtypes.bfloat16), (b * 1.01).astype(ml_dtypes.bfloat16)),
        "cast": (a.astype(np.float32), a.astype(ml_dtypes.bfloat16)),  # F32 against its BF16
        "i32": (ints_a, ints_b),
        "mixed": (ints_a, ints_b.astype(np.float32) + 0.25),
        "c64": (
            (a + 1j).astype(np.complex64),
            (b + 1j).astype(np.complex64),
        ),
        "same": (a, a.copy()),
    }


@pytest.mark.usefixtures("small_chunks")
def test_chunked_diff_is_the_whole_arrays_and_the_same_with_any_number_of_workers(
    cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pysafetensors._cli._cmd_diff import (
        _any_differences,
        _comparable,
        _integer_differences,
    )

    with np.errstate(over="ignore"):  # 1.7e308 as a float32 or a complex64: Inf
        pairs = _pairs(np.random.default_rng(11))
    fa, fb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({k: v[0] for k, v in pairs.items()}, str(fa))
    save_file({k: v[1] for k, v in pairs.items()}, str(fb))
    runs = []
    for cores in (1, 3):
        monkeypatch.setattr(_chunk_work, "_usable_cores", lambda cores=cores: cores)
        r = cli("diff", fa, fb, "--json", "--atol", "1e-4", "--rtol", "1e-3")
        assert r.code == 1, r.err
        runs.append({t["name"]: t["values"] for t in r.json()["tensors"]})
    assert runs[0] == runs[1]
    with np.errstate(all="ignore"):
        for name, (a, b) in pairs.items():
            row = runs[0][name]
            if name == "same":
                assert row["identical"] and row["differing"] == 0
                continue
            # The whole arrays at once, by the general comparison: what each chunk must add to.
            if a.dtype.kind in "iu" and b.dtype.kind in "iu":
                differ, big, rel, outside = _integer_differences(a, b, 1e-4, 1e-3)
            else:
                d = _any_differences(*_comparable(a, b), 1e-4, 1e-3)
                differ, big, rel, outside = d.differ, d.max_abs, d.max_rel, d.outside
            assert row["differing"] == differ, name
            assert row["outside_tolerance"] == outside, name
            assert row["max_abs"] == (big if np.isfinite(big) else None), name
            assert row["max_rel"] == (rel if np.isfinite(rel) else None), name
    assert runs[0]["f64"]["max_abs"] is None  # Inf against 5, and the overflowing difference
    assert runs[0]["cast"]["differing"] > 0 and runs[0]["cast"]["max_abs"] is not None


@pytest.mark.parametrize(
    "target", ["F16", "F32", "F64", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"]
)
def test_every_bf16_bit_pattern_casts_as_ml_dtypes_casts_it(
    cli, tmp_path: Path, target: str
) -> None:
    # BF16 is widened by its bits, then cast once; NaN become the quiet NaN of their sign in
    # F16, as ml_dtypes makes them (numpy would keep payload bits).
    bits = np.arange(1 << 16, dtype=np.uint16)
    src, out = tmp_path / "bf16.safetensors", tmp_path / "out.safetensors"
    save_file({"all": bits.view(ml_dtypes.bfloat16)}, str(src))
    r = cli("cast", src, out, "--to", target)
    assert r.code == 0, r.err
    want = numpy_dtype(dtype_from_code(target))
    with np.errstate(all="ignore"):
        expected = bits.view(ml_dtypes.bfloat16).astype(want)
    got = load_file(str(out))["all"]
    assert got.dtype == want
    assert got.tobytes() == expected.tobytes()


def test_bf16_to_f32_cast_does_not_import_ml_dtypes(tmp_path: Path) -> None:
    src, out = tmp_path / "bf16.safetensors", tmp_path / "f32.safetensors"
    array = (np.arange(-500, 1500) / 7).astype(ml_dtypes.bfloat16)
    save_file({"w": array}, str(src))
    assert _run_fresh("-q", "cast", str(src), str(out), "--to", "F32")[::2] == (0, False)
    assert np.array_equal(load_file(str(out))["w"], array.astype(np.float32))


@pytest.mark.usefixtures("small_chunks")
def test_chunked_cast_is_numpys_and_counts_what_overflowed(
    cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(5)
    values = rng.standard_normal(10_500).astype(np.float32) * 100
    values[[17, 3_333, 9_999]] = [1e6, -7e4, 3e38]  # beyond F16: Inf
    values[[20, 5_000]] = [np.inf, np.nan]  # already not finite: not counted
    src = tmp_path / "f32.safetensors"
    save_file({"v": values, "small": values[:10].copy()}, str(src))
    outputs = []
    for cores in (1, 3):
        monkeypatch.setattr(_chunk_work, "_usable_cores", lambda cores=cores: cores)
        out = tmp_path / f"f16-{cores}.safetensors"
        r = cli("cast", src, out, "--to", "F16")
        assert r.code == 0, r.err
        assert "warning: 3 finite values of v became Inf/NaN in F16" in r.err
        assert "of small" not in r.err
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]
    with np.errstate(over="ignore"):
        assert load_file(str(tmp_path / "f16-1.safetensors"))["v"].tobytes() == (
            values.astype(np.float16).tobytes()
        )


# A thread running the commands after the main thread returned: concurrent.futures pools then
# refuse new work ("cannot schedule new futures after interpreter shutdown"), so the chunks
# are worked on in that thread.
LATE = """
import sys, threading, time
from pysafetensors._cli import main

def run():
    while threading.main_thread().is_alive():
        time.sleep(0.01)
    path, out = sys.argv[1:]
    cast = ["cast", path, out, "--to", "F16"]
    for args in (["stats", "--json", path], ["diff", path, path], cast):
        print(args[0], main(["-q", *args]), flush=True)

threading.Thread(target=run).start()
"""


def test_the_commands_in_a_thread_after_the_main_thread_returned(tmp_path: Path) -> None:
    path = tmp_path / "big.safetensors"
    values = np.random.default_rng(2).standard_normal(3 << 20).astype(np.float32)  # 12 chunks
    save_file({"w": values}, str(path))
    proc = subprocess.run(
        [sys.executable, "-c", LATE, str(path), str(tmp_path / "f16.safetensors")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    codes = [line for line in proc.stdout.splitlines() if line.endswith((" 0", " 1", " 2"))]
    assert codes == ["stats 0", "diff 0", "cast 0"], proc.stdout[-2000:]
    stats = json.loads(proc.stdout[proc.stdout.index("{") : proc.stdout.rindex("}") + 1])
    assert stats["tensors"][0]["mean"] == pytest.approx(float(values.astype(np.float64).mean()))
    assert np.array_equal(
        load_file(str(tmp_path / "f16.safetensors"))["w"], values.astype(np.float16)
    )


def test_no_scratch_is_kept_by_the_calling_thread_after_a_command(cli, tmp_path: Path) -> None:
    # A one-chunk tensor is worked on in the calling thread; a histogram of many bins reads
    # chunks of 4 values a bin: 48 MB of scratch stayed with the main thread after main().
    path = tmp_path / "one.safetensors"
    save_file({"w": np.random.default_rng(0).standard_normal(200_000)}, str(path))
    assert cli("stats", path, "--json", "--histogram", "1000000").code == 0
    held = _chunk_work._scratch
    assert all(a.size == 0 for a in held.float64) and held.uint32.size == 0
    assert held.masks.size == 0


def test_bf16_diff_with_nan_does_not_import_ml_dtypes(tmp_path: Path) -> None:
    a = (np.arange(-500, 1500) / 7).astype(ml_dtypes.bfloat16)
    b = a.copy()
    a[3], b[3] = np.nan, np.nan
    b[10] = np.inf
    fa, fb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"w": a}, str(fa))
    save_file({"w": b}, str(fb))
    code, out, imported = _run_fresh("-q", "diff", "--json", str(fa), str(fb))
    assert (code, imported) == (1, False)
    (row,) = json.loads(out)["tensors"]
    assert row["values"]["differing"] == 1 and row["values"]["max_abs"] is None


@pytest.mark.usefixtures("small_chunks")
def test_merged_mean_near_the_float64_maximum_does_not_overflow(cli, tmp_path: Path) -> None:
    # A chunk whose finite values average -1.7e308 followed by one averaging +1.7e308: the
    # merge's step (delta * n / total * scale) was 3.4e308, so the mean became inf and
    # ``--json`` failed ("Out of range float values are not JSON compliant").
    values = np.full(2 * CHUNK, np.nan)
    values[0] = -1.7e308
    values[CHUNK:] = 1.7e308
    path = tmp_path / "edge.safetensors"
    save_file({"v": values}, str(path))
    row = _stats(cli, path)["v"]
    want = _expected(values)
    assert row["mean"] == pytest.approx(want["mean"], rel=1e-12)
    assert row["std"] == pytest.approx(want["std"], rel=1e-12)


@pytest.mark.usefixtures("small_chunks")
def test_the_sign_of_a_zero_extreme_does_not_depend_on_the_chunks(cli, tmp_path: Path) -> None:
    zeros, negative = np.zeros(CHUNK), -np.zeros(CHUNK)
    tensors = {
        "pos_then_neg": np.concatenate([zeros, negative, [1.0]]),
        "neg_then_pos": np.concatenate([negative, zeros, [-1.0]]),
    }
    path = tmp_path / "zeros.safetensors"
    save_file(tensors, str(path))
    rows = _stats(cli, path)
    # -0.0 is the smaller zero, +0.0 the larger (numpy's whole-array min of the first: -0.0).
    assert str(rows["pos_then_neg"]["min"]) == "-0.0"
    assert str(rows["neg_then_pos"]["max"]) == "0.0"


def test_validate_counts_bf16_nan_and_inf_by_their_bits_without_ml_dtypes(tmp_path: Path) -> None:
    bits = np.arange(1 << 16, dtype=np.uint16)
    path = tmp_path / "all.safetensors"
    save_file({"all": bits.view(ml_dtypes.bfloat16)}, str(path))
    code, out, imported = _run_fresh("validate", "--strict", str(path))
    assert (code, imported) == (1, False)  # warnings fail --strict
    with np.errstate(invalid="ignore"):
        values = bits.view(ml_dtypes.bfloat16).astype(np.float32)
    nan, inf = int(np.isnan(values).sum()), int(np.isinf(values).sum())
    assert f"BF16 tensor holds {nan} NaN and {inf} Inf values" in out, out


@pytest.mark.parametrize(
    "code", ["F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F4", "F6_E2M3"]
)
def test_codes_of_small_floats_are_looked_up_as_ml_dtypes_converts_them(code: str) -> None:
    from pysafetensors._adapter import chunk_values

    dtype = dtype_from_code(code)
    raw = np.tile(np.arange(256, dtype=np.uint8), 3)  # every byte; F6 groups of 3 bytes
    with np.errstate(invalid="ignore", over="ignore"):
        want = chunk_values(dtype, raw).astype(np.float64)
        got, integers = _chunk_work.as_float64(dtype, raw)
    assert integers is None and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))
