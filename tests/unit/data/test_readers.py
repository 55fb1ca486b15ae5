from __future__ import annotations

import gzip
import json
import pickle
import sys

import pytest

from shardlm.data.sources import BadRecords, Unit, plan_units, read_records, read_texts, resolve_sources
from shardlm.errors import ConfigError, DataError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstd = pytest.importorskip("zstandard")


def _texts(files, text_field="text", chunk_bytes=64 << 20, keep=5):
    """(texts, BadRecords) of all units, per-unit counts merged in unit order."""
    out, bad = [], BadRecords(keep=keep)
    for unit in plan_units(files, chunk_bytes):
        got = BadRecords(keep=keep)
        out += read_texts(unit, text_field, got)
        bad.merge(got)
    return out, bad


# -- parquet, arrow, datasets folders --------------------------------------------------------------------
def test_parquet_one_unit_per_row_group_in_order_and_a_null_is_one_bad_row(tmp_path):
    rows = [f"doc {i}" for i in range(10)]
    rows[6] = None
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": list(range(10)), "body": rows}), f, row_group_size=4)
    units = plan_units([f])
    assert [(u.kind, u.part, u.first_line) for u in units] == [("parquet", 0, 1), ("parquet", 1, 5), ("parquet", 2, 9)]
    assert all(pickle.loads(pickle.dumps(u)) == u for u in units)
    texts, bad = _texts([f], "body")
    assert texts == [r for r in rows if r is not None]
    assert (bad.total, bad.bad, bad.examples) == (10, 1, [f"{f} row 7 (null 'body')"])
    with pytest.raises(ConfigError, match=r"d.parquet: no column 'text' \(columns: id, body\); set data.text_field"):
        _texts([f], "text")
    with pytest.raises(ConfigError, match=r"column 'id' holds int64, not strings"):
        _texts([f], "id")
    records = [r for u in units for r in read_records(u, BadRecords())]
    assert records[1] == ({"id": 1, "body": "doc 1"}, f"{f} row 2")


@pytest.mark.parametrize("fmt", ["file", "stream"])
def test_arrow_ipc_file_and_stream_one_unit_per_batch(tmp_path, fmt):
    f = tmp_path / f"{fmt}.arrow"
    batches = [pa.record_batch({"text": [f"{b}-{i}" for i in range(3)]}) for b in range(3)]
    batches[1] = pa.record_batch({"text": ["1-0", None, ""]})
    new = pa.ipc.new_file if fmt == "file" else pa.ipc.new_stream
    with new(str(f), batches[0].schema) as w:
        for b in batches:
            w.write_batch(b)
    units = plan_units([f])
    assert [(u.kind, u.part, u.first_line) for u in units] == [("arrow", 0, 1), ("arrow", 1, 4), ("arrow", 2, 7)]
    texts, bad = _texts([f])
    assert texts == ["0-0", "0-1", "0-2", "1-0", "2-0", "2-1", "2-2"]  # the empty text is good, and yields nothing
    assert (bad.total, bad.bad, bad.examples) == (9, 1, [f"{f} row 5 (null 'text')"])


def test_a_datasets_folder_is_one_source_in_state_json_order(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": [f"t{i}" for i in range(6)], "n": list(range(6))})
    ds.save_to_disk(str(tmp_path / "ds"), num_shards=2)
    state = json.loads((tmp_path / "ds" / "state.json").read_text())
    want = [tmp_path / "ds" / e["filename"] for e in state["_data_files"]]
    assert len(want) == 2
    assert resolve_sources(str(tmp_path / "ds")) == want
    (tmp_path / "a.txt").write_text("first")
    assert resolve_sources(str(tmp_path)) == [tmp_path / "a.txt", *want]  # inside a folder: one source, no cache files
    assert _texts(want)[0] == [f"t{i}" for i in range(6)]
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError) as e:
        resolve_sources(str(tmp_path / "dd"))
    msg = str(e.value)
    assert "DatasetDict (splits: train, test)" in msg and str(tmp_path / "dd" / "train") in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="DatasetDict"):  # also when found inside a folder
        resolve_sources(str(tmp_path))


# -- jsonl, .gz, .zst ------------------------------------------------------------------------------------
RECORDS = [{"text": "alpha"}, {"text": "béta ☃"}, None, {"text": "gamma\nwith a newline"}, {"other": 1},
           {"text": ""}, {"text": "delta"}, {"text": 7}, {"text": None}, [1], {"text": "eps\u2028ilon"}]


def _jsonl_bytes() -> bytes:
    lines = ["{not json" if r is None else json.dumps(r, ensure_ascii=False) for r in RECORDS]
    lines.insert(2, "")  # a blank line: no record, but it counts for line numbers
    return ("\n".join(lines) + "\n").encode()


WANT_TEXTS = ["alpha", "béta ☃", "gamma\nwith a newline", "delta", "eps\u2028ilon"]
WANT_BAD = ["not valid JSON: Expecting property name enclosed in double quotes at column 2", "missing field 'text'",
            "non-string 'text': int", "null 'text'", "not a JSON object: list"]
WANT_LINES = [4, 6, 9, 10, 11]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_jsonl_gz_zst_give_the_same_texts_and_bad_lines(tmp_path, suffix):
    data = _jsonl_bytes()
    f = tmp_path / f"d{suffix}"
    f.write_bytes({".jsonl": data, ".jsonl.gz": gzip.compress(data),
                   ".jsonl.zst": zstd.ZstdCompressor().compress(data)}[suffix])
    texts, bad = _texts([f])
    assert texts == WANT_TEXTS
    assert bad.examples == [f"{f}:{n} ({why})" for n, why in zip(WANT_LINES, WANT_BAD)]
    assert (bad.total, bad.bad) == (len(RECORDS), 5)
    assert bad.by_reason == {"not valid JSON": 1, "missing field 'text'": 1, "non-string 'text'": 1,
                             "null 'text'": 1, "not a JSON object": 1}
    records = [r for u in plan_units([f]) for r in read_records(u, BadRecords())]
    assert records[0] == ({"text": "alpha"}, f"{f}:1") and records[3] == ({"other": 1}, f"{f}:6")


def test_zst_with_several_frames_is_read_to_the_end(tmp_path):
    f = tmp_path / "d.jsonl.zst"
    c = zstd.ZstdCompressor()
    f.write_bytes(c.compress(b'{"text": "a"}\n') + c.compress(b'{"text": "b"}\n'))
    assert _texts([f])[0] == ["a", "b"]


@pytest.mark.parametrize("cut", [0.5, 0.9, "second frame"])
def test_a_truncated_zst_is_a_one_line_data_error(tmp_path, cut):
    """A .zst cut short used to read as empty or short (zstandard's stream reader stops at the cut without an
    error), so a folder of shards became a store of a third of the documents with exit 0."""
    f = tmp_path / "d.jsonl.zst"
    c = zstd.ZstdCompressor()
    whole = c.compress(b'{"text": "a"}\n' * 2000)
    if cut == "second frame":  # the first frame whole, the second cut: the first's records must not pass alone
        data = whole + c.compress(b'{"text": "b"}\n' * 2000)[:-10]
    else:
        data = whole[: int(len(whole) * cut)]
    f.write_bytes(data)
    with pytest.raises(DataError, match=r"d.jsonl.zst: cannot decompress .* truncated or corrupt") as e:
        _texts([f])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_a_truncated_columnar_file_is_a_one_line_data_error(tmp_path, suffix):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / f"d{suffix}"
    table = pa.table({"text": [f"document {i} " * 20 for i in range(2000)]})
    if suffix == ".parquet":
        pq.write_table(table, f, row_group_size=500)
    else:
        with pa.ipc.new_file(f, table.schema) as w:
            w.write_table(table, max_chunksize=500)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(DataError) as e:
        _texts([f])
    assert str(f) in str(e.value) and "\n" not in str(e.value)


def test_a_corrupt_gz_is_a_one_line_data_error(tmp_path):
    f = tmp_path / "d.jsonl.gz"
    f.write_bytes(gzip.compress(b'{"text": "a"}\n' * 100)[:-20])
    with pytest.raises(DataError, match=r"d.jsonl.gz: cannot decompress .* truncated or corrupt"):
        _texts([f])


def test_byte_range_units_cut_at_lines_and_lose_or_repeat_nothing(tmp_path):
    data = _jsonl_bytes() * 3  # 12 lines each
    f = tmp_path / "d.jsonl"
    f.write_bytes(data)
    whole = _texts([f], keep=100)
    assert whole[0] == WANT_TEXTS * 3
    assert whole[1].examples == [f"{f}:{n + 12 * k} ({why})" for k in range(3) for n, why in zip(WANT_LINES, WANT_BAD)]
    newlines = [i for i, b in enumerate(data) if b == ord("\n")]
    sizes = {1, 2, 7, 30, newlines[0] + 1, newlines[0] + 2, newlines[3] - newlines[0], len(data) // 2, newlines[-2] + 1}
    for chunk in sorted(sizes):
        units = plan_units([f], chunk_bytes=chunk)
        assert len(units) > 1, chunk
        assert [u.part for u in units] == list(range(len(units)))
        assert units[0].start == 0 and units[-1].stop == len(data)
        assert all(a.stop == b.start and data[b.start - 1] == ord("\n") for a, b in zip(units, units[1:])), chunk
        assert all(u.first_line == data[: u.start].count(b"\n") + 1 for u in units), chunk
        assert _texts([f], chunk_bytes=chunk, keep=100) == whole, chunk  # same texts, same 1-based line numbers
    assert len(plan_units([f], chunk_bytes=1)) == 36  # one line each (the blank ones too)
    for chunk in (len(data), len(data) - 1):  # small, or no newline to cut at before the last: the whole file
        assert plan_units([f], chunk_bytes=chunk) == [Unit(str(f), "jsonl", 0)]


def test_a_cut_exactly_after_a_newline_starts_the_next_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"text": "a"}\n{"text": "b"}\n{"text": "c"}\n')  # 14 bytes a line
    units = plan_units([f], chunk_bytes=14)  # the first newline is the chunk's last byte
    assert [(u.start, u.stop, u.first_line) for u in units] == [(0, 14, 1), (14, 28, 2), (28, 42, 3)]
    units = plan_units([f], chunk_bytes=15)  # one byte into the second line: cut after it
    assert [(u.start, u.stop, u.first_line) for u in units] == [(0, 28, 1), (28, 42, 3)]


# -- BadRecords ------------------------------------------------------------------------------------------
def _bad(total: int, *bad: tuple[str, str]) -> BadRecords:
    b = BadRecords()
    b.add_good(total - len(bad))
    for where, why in bad:
        b.add_bad(where, why)
    return b


def test_bad_records_line_check_merge_and_round_trip():
    assert BadRecords().line() is None and _bad(5).line() is None
    b = _bad(12_345, ("a.jsonl:12", "not valid JSON"), ("b.parquet row 7", "missing field 'text'"),
             ("c.jsonl:3", "missing field 'text'"))
    assert b.line() == ("data: 3 of 12,345 records skipped (2 missing field 'text', 1 not valid JSON): a.jsonl:12 "
                        "(not valid JSON), b.parquet row 7 (missing field 'text'), c.jsonl:3 (missing field 'text')")
    b.add_bad("d.jsonl:1", "not valid JSON", "Expecting value at column 1")
    assert b.examples[-1] == "d.jsonl:1 (not valid JSON: Expecting value at column 1)"
    assert BadRecords.from_dict(json.loads(json.dumps(b.to_dict()))) == b

    ten = _bad(1000, ("x:1", "r"))  # 0.1%: at the limit, not past it
    ten.check(0.001)
    ten.add_bad("x:2", "r")
    with pytest.raises(DataError) as e:
        ten.check(0.001)
    assert str(e.value) == ("data: 2 of 1,001 records are bad (0.20%, more than data.max_bad_fraction=0.001): "
                            "x:1 (r), x:2 (r); fix the data or raise data.max_bad_fraction")
    BadRecords().check(0.0)

    many = [_bad(3, *((f"u{i}:{j}", "r") for j in range(2))) for i in range(4)]
    merged = BadRecords()
    for m in many:
        merged.merge(m)
    assert (merged.total, merged.bad, merged.by_reason) == (12, 8, {"r": 8})
    assert merged.examples == ["u0:0 (r)", "u0:1 (r)", "u1:0 (r)", "u1:1 (r)", "u2:0 (r)"]
    assert merged.line().endswith("u2:0 (r), ...")


# -- resolve_sources -------------------------------------------------------------------------------------
def test_resolve_sources_directories_globs_and_clear_errors(tmp_path):
    (tmp_path / "sub" / "deep").mkdir(parents=True)
    for name in ("b.jsonl", "a.txt", "sub/c.parquet", "sub/deep/d.jsonl.zst", "sub/e.arrow", "sub/x.csv", "f.jsonl.gz"):
        (tmp_path / name).write_bytes(b"")
    got = resolve_sources(str(tmp_path))
    assert [p.relative_to(tmp_path).as_posix() for p in got] == [
        "a.txt", "b.jsonl", "f.jsonl.gz", "sub/c.parquet", "sub/deep/d.jsonl.zst", "sub/e.arrow"]
    assert resolve_sources(str(tmp_path / "**" / "*.jsonl*")) == [
        tmp_path / "b.jsonl", tmp_path / "f.jsonl.gz", tmp_path / "sub" / "deep" / "d.jsonl.zst"]
    assert resolve_sources(str(tmp_path / "b.jsonl")) == [tmp_path / "b.jsonl"]
    with pytest.raises(ConfigError, match=r"'.*nope' does not exist; pass a token store \(store:DIR\), a file "
                                          r"\(.txt, .jsonl, .*\), a directory"):
        resolve_sources(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"x.csv': unsupported file type; use .txt, .jsonl, .jsonl.gz"):
        resolve_sources(str(tmp_path / "sub" / "x.csv"))
    with pytest.raises(ConfigError, match=r"holds no data files"):
        resolve_sources(str(tmp_path / "*.csv"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"empty' holds no data files"):
        resolve_sources(str(tmp_path / "empty"))


def test_text_units_are_one_record_and_bad_utf8_is_a_bad_record(tmp_path):
    (tmp_path / "a.txt").write_text("hello\nworld")
    (tmp_path / "b.txt").write_bytes(b"ok \xff")
    (tmp_path / "c.txt").write_text("")
    texts, bad = _texts(resolve_sources(str(tmp_path)))
    assert texts == ["hello\nworld"]
    assert (bad.total, bad.examples) == (3, [f"{tmp_path / 'b.txt'} (not valid UTF-8: invalid start byte at byte 3)"])
    with pytest.raises(ConfigError, match="a text file has no records"):
        list(read_records(plan_units([tmp_path / "a.txt"])[0], BadRecords()))


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_a_file_that_is_not_parquet_or_arrow_is_a_one_line_data_error(tmp_path, suffix):
    f = tmp_path / f"d{suffix}"
    f.write_bytes(b"not columnar data at all\n")
    with pytest.raises(DataError, match=rf"d\{suffix}: not a readable (Parquet|Arrow IPC) file .*; fix or remove it"):
        plan_units([f])


def test_txt_and_jsonl_need_no_extra_and_parquet_names_it(tmp_path, monkeypatch):
    for name in ("pyarrow", "pyarrow.parquet", "pyarrow.ipc", "zstandard"):
        monkeypatch.setitem(sys.modules, name, None)  # as if the [data] extra were not installed
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(b'{"text": "b"}\n'))
    assert _texts(resolve_sources(str(tmp_path)))[0] == ["a", "b"]
    (tmp_path / "c.parquet").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"reading .parquet files needs pyarrow \(not installed\): "
                                          r"pip install 'shardlm\[data\]'"):
        plan_units([tmp_path / "c.parquet"])
    (tmp_path / "d.jsonl.zst").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"reading .jsonl.zst files needs zstandard \(not installed\)"):
        _texts([tmp_path / "d.jsonl.zst"])
