"""Random-access document sources (jaxpar.data.sources): the same 200 documents written as JSON
lines (plain and gzip), Parquet, ArrayRecord and a save_to_disk directory read back by number and
in order; several files as one source; fingerprints; the bytes counted; every error message."""
import doctest
import gzip
import json
import os
import random
import sys

import pytest

from jaxpar.data import sources
from jaxpar.data.sources import _jsonl as sources_jsonl
from jaxpar.errors import SourceError
from jaxpar.data.sources import FORMATS, open_source
from jaxpar.data.sources._jsonl import LineFile

KINDS = ("jsonl", "jsonl_gz", "parquet", "arrayrecord", "hf_disk")


def make_docs(n=200, seed=0):
    rng = random.Random(seed)
    words = ["alpha", "beta", "ñandú", "日本語", "emoji 🙂", "tab\tin", 'quote "q"', "back\\slash", "x" * 300]
    docs = []
    for i in range(n):
        text = f"doc {i}: " + " ".join(rng.choice(words) for _ in range(rng.randrange(0, 40)))
        docs.append(text + ("\nsecond line\n\nthird" if i % 7 == 3 else ""))
    docs[5] = ""
    return docs


DOCS = make_docs()


def record(i, text):
    return {"id": i, "text": text, "meta": {"body": text.upper()}}


def jsonl_lines(docs, first=0):
    return [json.dumps(record(first + k, d), ensure_ascii=k % 2 == 0).encode() for k, d in enumerate(docs)]


def write(kind, directory, docs, first=0):
    """``docs`` written in one file (a directory for hf_disk) of ``kind``; returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    if kind in ("jsonl", "jsonl_gz"):
        data = b"\n".join(jsonl_lines(docs, first)) + b"\n"
        path = directory / f"part{first:04d}.jsonl"
        if kind == "jsonl_gz":
            path, data = path.with_suffix(".jsonl.gz"), gzip.compress(data)
        path.write_bytes(data)
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        path = directory / f"part{first:04d}.parquet"
        table = pa.Table.from_pylist([record(first + k, d) for k, d in enumerate(docs)])
        pq.write_table(table, path, row_group_size=32)
    elif kind == "arrayrecord":
        from array_record.python.array_record_module import ArrayRecordWriter
        path = directory / f"part{first:04d}.array_record"
        writer = ArrayRecordWriter(str(path), "group_size:1")
        for k, d in enumerate(docs):
            writer.write(json.dumps(record(first + k, d)).encode())
        writer.close()
    else:
        import datasets
        datasets.disable_progress_bars()
        path = directory / f"part{first:04d}"
        datasets.Dataset.from_list([record(first + k, d) for k, d in enumerate(docs)]).save_to_disk(str(path))
    return path


def split_write(kind, directory, docs, sizes=(70, 60, 70)):
    paths, first = [], 0
    for size in sizes:
        paths.append(write(kind, directory, docs[first:first + size], first))
        first += size
    return paths


@pytest.mark.parametrize("kind", KINDS)
def test_reads_the_documents_by_number_and_in_order(kind, tmp_path):
    source = open_source(write(kind, tmp_path, DOCS))
    assert source.format == kind.removesuffix("_gz") and len(source) == len(DOCS)
    order = random.Random(1).choices(range(len(DOCS)), k=300)
    assert source.texts(order) == [DOCS[i] for i in order]
    assert source.texts([]) == []
    assert [t for chunk in source.iter_texts(chunk=17) for t in chunk] == DOCS
    assert [len(c) for c in source.iter_texts(5, 50, chunk=20)] == [20, 20, 5]
    assert sum(source.iter_texts(5, 50, chunk=20), []) == DOCS[5:50]
    nested = open_source(write(kind, tmp_path / "again", DOCS), text_field="meta.body")
    assert nested.texts([199, 3, 0]) == [DOCS[199].upper(), DOCS[3].upper(), DOCS[0].upper()]


@pytest.mark.parametrize("kind", KINDS)
def test_several_files_form_one_source(kind, tmp_path):
    paths = split_write(kind, tmp_path, DOCS)
    pattern = str(tmp_path / "part*")
    for path in (pattern, list(reversed(paths))[::-1], [pattern]):
        source = open_source(path)
        assert len(source) == 200 and source.name.endswith("(+2 files)")
        order = random.Random(2).choices(range(200), k=100)
        assert source.texts(order) == [DOCS[i] for i in order]
        assert sum(source.iter_texts(chunk=64), []) == DOCS
    assert open_source([paths[2], paths[0]]).texts([0, 70]) == [DOCS[130], DOCS[0]]


def test_a_recursive_glob_is_sorted(tmp_path):
    write("jsonl", tmp_path / "b", DOCS[100:], 100)
    write("jsonl", tmp_path / "a" / "deep", DOCS[:100])
    assert sum(open_source(str(tmp_path / "**" / "*.jsonl")).iter_texts(), []) == DOCS


@pytest.mark.parametrize("kind", KINDS)
def test_fingerprint_names_the_files_and_changes_with_them(kind, tmp_path):
    paths = split_write(kind, tmp_path, DOCS, sizes=(100, 100))
    source = open_source(paths)
    first = source.fingerprint()
    assert json.loads(json.dumps(first)) == first and first == open_source(paths).fingerprint()
    assert first["format"] == kind.removesuffix("_gz") and first["text_field"] == "text"
    assert all(os.path.isabs(f["path"]) and f["size"] > 0 and f["mtime_ns"] > 0 for f in first["files"])
    changed = first["files"][-1]["path"]
    stamp = os.stat(changed).st_mtime_ns + 10**9
    os.utime(changed, ns=(stamp, stamp))
    assert source.fingerprint() != first
    assert open_source(paths, text_field="meta.body").fingerprint()["text_field"] == "meta.body"


def test_fingerprint_changes_when_a_file_is_rewritten(tmp_path):
    path = write("jsonl", tmp_path, DOCS)
    before = open_source(path).fingerprint()
    write("jsonl", tmp_path, DOCS[:-1])
    assert open_source(path).fingerprint()["files"][0]["size"] < before["files"][0]["size"]


def parquet_text_bytes(path, groups):
    import pyarrow.parquet as pq
    meta = pq.ParquetFile(path).metadata
    return sum(meta.row_group(g).column(c).total_compressed_size for g in groups
               for c in range(meta.num_columns) if meta.row_group(g).column(c).path_in_schema == "text")


def expected_bytes(kind, path, indices):
    """The payload bytes that reading ``indices`` (once each, cold) must count."""
    if kind in ("jsonl", "jsonl_gz"):
        lines = jsonl_lines(DOCS)
        return sum(len(lines[i]) + 1 for i in indices)
    if kind == "parquet":
        return parquet_text_bytes(path, sorted({i // 32 for i in indices}))
    if kind == "arrayrecord":
        return sum(len(json.dumps(record(i, DOCS[i])).encode()) for i in indices)
    return sum(len(DOCS[i].encode()) for i in indices)


@pytest.mark.parametrize("kind", KINDS)
def test_bytes_read_counts_only_what_was_read(kind, tmp_path):
    path = write(kind, tmp_path, DOCS)
    source = open_source(path)
    assert source.bytes_read == 0, "indexing reads no payload"
    source.texts([3])
    assert source.bytes_read == expected_bytes(kind, path, [3])
    source.texts([10, 4, 11, 10])
    assert source.bytes_read == expected_bytes(kind, path, [3]) + expected_bytes(kind, path, [4, 10, 11]) \
        - (expected_bytes(kind, path, [3]) if kind == "parquet" else 0)    # parquet: row group 0 is cached
    few, whole = open_source(path), open_source(path)
    few.texts(range(150, 160))
    sum(whole.iter_texts(), [])
    assert few.bytes_read == expected_bytes(kind, path, range(150, 160))
    assert whole.bytes_read == expected_bytes(kind, path, range(200)) > 4 * few.bytes_read


def test_parquet_decodes_only_the_row_groups_asked_for(tmp_path):
    path = write("parquet", tmp_path, DOCS)
    source = open_source(path)
    source.texts([40, 33, 63])                                          # all in row group 1
    assert source.bytes_read == parquet_text_bytes(path, [1])
    source.texts([70, 35])                                              # row group 2 decoded, 1 still cached
    assert source.bytes_read == parquet_text_bytes(path, [1, 2])
    source.texts([199, 0, 100])                                         # 6, 0, 3: all decoded, 1 and 2 evicted
    source.texts([40])
    assert source.bytes_read == parquet_text_bytes(path, [1, 2, 6, 0, 3, 1])


def test_blank_lines_are_not_documents_and_errors_name_the_line(tmp_path):
    path = tmp_path / "blank.jsonl"
    lines = jsonl_lines(DOCS[:3])
    path.write_bytes(b"\n  \r\n" + lines[0] + b"\r\n\n\t\n" + lines[1] + b"\n" + lines[2])     # no final newline
    source = open_source(path)
    assert len(source) == 3 and source.texts([2, 0, 1]) == [DOCS[2], DOCS[0], DOCS[1]]
    path.write_bytes(lines[0] + b"\n\n" + b'{"text": "ok"}\n' + b'{"text": 5, "id": 1}\n')
    with pytest.raises(SourceError, match=r"blank\.jsonl, line 4: field 'text' is a int, not a string"):
        open_source(path).texts([2])
    with pytest.raises(SourceError, match=r"blank\.jsonl, line 3: no field 'body' \(the keys: \['text'\]\)"):
        open_source(path, text_field="body").texts([1])
    with pytest.raises(SourceError, match=r"line 1: no field 'meta.size' \(the keys of 'meta': \['body'\]\)"):
        open_source(path, text_field="meta.size").texts([0])


@pytest.mark.parametrize("on_malformed", ["error", "skip"])
def test_a_malformed_line_raises_or_reads_as_none(on_malformed, tmp_path):
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"text": "a"}\n\n{"text": "b"\n[1, 2]\n{"text": "c"}\n'))
    source = open_source(path, on_malformed=on_malformed)
    assert len(source) == 4 and source.texts([0]) == ["a"]
    if on_malformed == "error":
        with pytest.raises(SourceError, match=r"bad\.jsonl\.gz, line 3: not valid JSON .*on_malformed='skip'"):
            source.texts([1])
        with pytest.raises(SourceError, match=r"bad\.jsonl\.gz, line 4: a JSON list, not an object"):
            source.texts([2])
    else:
        assert source.texts([3, 1, 2, 1]) == ["c", None, None, None] and source.skipped == 2
        assert sum(source.iter_texts(), []) == ["a", None, None, "c"] and source.skipped == 4


@pytest.mark.parametrize("kind", ["parquet", "hf_disk", "arrayrecord"])
def test_a_missing_or_non_string_field_names_the_file_and_the_fields(kind, tmp_path):
    path = write(kind, tmp_path, DOCS[:10])
    name = path.name.replace(".", r"\.")
    if kind == "arrayrecord":
        missing, wrong = r"record 0: no field 'body' \(the keys: \['id', 'meta', 'text'\]\)", \
            r"record 0: field 'id' is a int, not a string"
    else:
        missing, wrong = r"no column 'body' \(the columns: \['id', 'text', 'meta'\]\)", \
            r"column 'id' holds int64, not strings"
    with pytest.raises(SourceError, match=rf"{name}.*{missing}"):
        open_source(path, text_field="body").texts([0])
    with pytest.raises(SourceError, match=rf"{name}.*{wrong}"):
        open_source(path, text_field="id").texts([0])
    if kind != "arrayrecord":
        with pytest.raises(SourceError, match=r"no column 'meta.size' \(the fields of 'meta': \['body'\]\)"):
            open_source(path, text_field="meta.size")


def test_a_null_text_names_the_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": ["a", None, "c"]}), tmp_path / "nulls.parquet")
    source = open_source(tmp_path / "nulls.parquet")
    assert source.texts([2, 0]) == ["c", "a"]
    with pytest.raises(SourceError, match=r"nulls\.parquet, row 1: 'text' is null"):
        source.texts([0, 1])


def test_arrayrecord_records_that_are_not_json_objects_are_the_text(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter
    path = tmp_path / "raw.arrayrecord"
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for data in [b"plain text", b"{not json", b'"a json string"', "ünï".encode(), b"\xff\xfe", b'{"text": "t"}']:
        writer.write(data)
    writer.close()
    source = open_source(path, on_malformed="skip")
    assert source.texts(range(6)) == ["plain text", "{not json", '"a json string"', "ünï", None, "t"]
    assert source.skipped == 1 and source.bytes_read == 10 + 9 + 15 + 5 + 2 + 13
    with pytest.raises(SourceError, match=r"raw\.arrayrecord, record 4: not UTF-8"):
        open_source(path).texts([4])


def test_gzip_random_access_equals_the_plain_file(monkeypatch, tmp_path):
    monkeypatch.setattr(sources_jsonl, "SNAPSHOT_INTERVAL", 4096)
    monkeypatch.setattr(sources_jsonl, "GZIP_READ", 512)
    many = make_docs(2000, seed=3)
    data = b"\n".join(jsonl_lines(many)) + b"\n"
    (tmp_path / "big.jsonl").write_bytes(data)
    (tmp_path / "big.jsonl.gz").write_bytes(gzip.compress(data))
    (tmp_path / "members.jsonl.gz").write_bytes(gzip.compress(data[:70001]) + gzip.compress(data[70001:]))
    plain = LineFile(tmp_path / "big.jsonl")
    for name in ("big.jsonl.gz", "members.jsonl.gz"):
        packed = LineFile(tmp_path / name)
        assert len(packed.snapshots) > 20 and list(packed.starts) == list(plain.starts)
        rng = random.Random(4)
        for _ in range(50):
            start = rng.randrange(len(data))
            stop = min(len(data), start + rng.choice([1, 100, 5000, 20000]))
            assert packed.read(start, stop) == data[start:stop]
        source, reference = open_source(tmp_path / name), open_source(tmp_path / "big.jsonl")
        order = list(range(1999, -1, -7)) + rng.choices(range(2000), k=200)
        assert source.texts(order) == reference.texts(order) == [many[i] for i in order]
        assert sum(source.iter_texts(chunk=100), []) == sum(reference.iter_texts(chunk=100), []) == many
        assert source.bytes_read == reference.bytes_read
    first_member = len(gzip.compress(data[:70001]))
    monkeypatch.setattr(sources_jsonl, "GZIP_READ", first_member)     # a member ends exactly at a block's end
    packed = LineFile(tmp_path / "members.jsonl.gz")
    assert packed.read(69000, 72000) == data[69000:72000] and packed.read(1, 100) == data[1:100]


def test_a_gzip_read_restarts_from_the_nearest_snapshot(monkeypatch, tmp_path):
    monkeypatch.setattr(sources_jsonl, "SNAPSHOT_INTERVAL", 4096)
    monkeypatch.setattr(sources_jsonl, "GZIP_READ", 512)
    data = b"\n".join(jsonl_lines(make_docs(2000, seed=5))) + b"\n"
    (tmp_path / "big.jsonl.gz").write_bytes(gzip.compress(data))
    packed = LineFile(tmp_path / "big.jsonl.gz")
    inflated, inflate = [], sources_jsonl.inflate

    def counting(*args):
        for step in inflate(*args):
            inflated.append(len(step[2]))     # decompressed bytes
            yield step

    monkeypatch.setattr(sources_jsonl, "inflate", counting)
    for start in (len(data) - 10, len(data) // 2, 1000):                   # backwards: no cursor to reuse
        inflated.clear()
        assert packed.read(start, start + 10) == data[start:start + 10]
        assert sum(inflated) < 4096 + 2 * 5000 < len(data) // 50
    inflated.clear()
    assert packed.read(1010, 1200) == data[1010:1200] and sum(inflated) < 5000     # continues from the cursor


def test_a_truncated_or_damaged_gzip_file_is_named(tmp_path):
    data = gzip.compress(b"\n".join(jsonl_lines(DOCS)))
    (tmp_path / "cut.jsonl.gz").write_bytes(data[:len(data) // 2])
    with pytest.raises(SourceError, match=r"cut\.jsonl\.gz: not a complete gzip file"):
        open_source(tmp_path / "cut.jsonl.gz")
    (tmp_path / "junk.json.gz").write_bytes(b"not gzip at all")
    with pytest.raises(SourceError, match=r"junk\.json\.gz: damaged gzip data"):
        open_source(tmp_path / "junk.json.gz")


def test_paths_and_formats_that_cannot_be_opened(tmp_path):
    write("jsonl", tmp_path, DOCS[:3])
    with pytest.raises(SourceError, match=r"nothere\.jsonl: no such file"):
        open_source(tmp_path / "nothere.jsonl")
    with pytest.raises(SourceError, match=r"\*\.parquet: the pattern matches no file"):
        open_source([tmp_path / "*.jsonl", str(tmp_path / "*.parquet")])
    with pytest.raises(SourceError, match="empty list"):
        open_source([])
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(SourceError, match=r"data\.csv: cannot tell the format .*" + r".*".join(FORMATS)):
        open_source(tmp_path / "data.csv")
    with pytest.raises(SourceError, match=r"format='csv': unknown; the formats are \('jsonl', 'parquet'"):
        open_source(tmp_path / "data.csv", format="csv")
    assert open_source(tmp_path / "data.csv", format="jsonl", on_malformed="skip").texts([0]) == [None]
    write("parquet", tmp_path, DOCS[:3], 3)
    with pytest.raises(SourceError, match=r"several formats: jsonl \(.*\), parquet \(.*part0003\.parquet\)"):
        open_source(str(tmp_path / "part*"))
    with pytest.raises(SourceError, match=r"a directory; the jsonl format reads files"):
        open_source(tmp_path, format="jsonl")
    with pytest.raises(SourceError, match=r"not a directory written by Dataset.save_to_disk"):
        open_source(tmp_path)
    with pytest.raises(SourceError, match=r"on_malformed='ignore': must be one of \('error', 'skip'\)"):
        open_source(tmp_path / "part0000.jsonl", on_malformed="ignore")


def test_empty_sources(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "blank.jsonl").write_bytes(b"\n \n\r\n")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    for name in ("empty.jsonl", "blank.jsonl", "empty.parquet"):
        with pytest.raises(SourceError, match=rf"{name.replace('.', r'[.]')}: no documents"):
            open_source(tmp_path / name)
    write("jsonl", tmp_path, DOCS[:2])
    assert len(open_source(sorted(map(str, tmp_path.glob("*.jsonl"))))) == 2     # empty files beside others


def test_a_dataset_dict_directory_names_its_splits(tmp_path):
    import datasets
    datasets.disable_progress_bars()
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS[:4]}),
                                   "test": datasets.Dataset.from_dict({"text": DOCS[4:6]})})
    splits.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(SourceError, match=r"dd: a DatasetDict with splits \['train', 'test'\]; .*DIR/<split>"):
        open_source(tmp_path / "dd")
    assert open_source(tmp_path / "dd" / "test").texts([1, 0]) == [DOCS[5], DOCS[4]]


@pytest.mark.parametrize("kind,module", [("parquet", "pyarrow.parquet"), ("hf_disk", "pyarrow.ipc"),
                                         ("arrayrecord", "grain.sources")])
def test_a_missing_optional_package_says_how_to_install_it(kind, module, tmp_path, monkeypatch):
    path = write(kind, tmp_path, DOCS[:3])
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(SourceError, match=rf"the {kind} format needs .*pip install 'jaxpar\[data\]'"):
        open_source(path)


def test_indices_out_of_range_and_bad_arguments(tmp_path):
    source = open_source(write("jsonl", tmp_path, DOCS[:10]))
    with pytest.raises(IndexError, match=r"document 10 out of range \(the source has 10 documents\)"):
        source.texts([0, 10])
    with pytest.raises(IndexError, match="document -1"):
        source.texts([-1])
    with pytest.raises(SourceError, match="1-D sequence of ints"):
        source.texts([0.5])
    with pytest.raises(IndexError, match="start=3, stop=11 outside 0..10"):
        source.iter_texts(3, 11)
    with pytest.raises(SourceError, match="chunk=0"):
        source.iter_texts(chunk=0)
    assert source.texts(i for i in (9, 1)) == [DOCS[9], DOCS[1]]


def test_the_module_example_runs():
    assert doctest.testmod(sources, optionflags=doctest.ELLIPSIS).failed == 0
