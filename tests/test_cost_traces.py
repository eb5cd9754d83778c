"""Trace reader shared by the planner and the load tester: both formats, plain or compressed,
clear errors."""

from __future__ import annotations

import gzip
import lzma
from pathlib import Path

import pytest

from gateway.cost import TraceError, read_trace

TRACES = Path(__file__).resolve().parents[1] / "traces"
AZURE = TRACES / "azure_llm_2023_conv.csv.xz"
MOONCAKE = TRACES / "mooncake_conversation.jsonl.xz"


def test_reads_both_public_traces() -> None:
    azure = read_trace(AZURE)
    assert len(azure) == 19_366
    assert (azure[0].arrival_s, azure[0].prompt_tokens, azure[0].output_tokens) == (0.0, 374, 44)
    assert azure[-1].arrival_s == pytest.approx(3501.72, abs=0.01)
    mooncake = read_trace(MOONCAKE)
    assert len(mooncake) == 12_031
    assert mooncake[0].prompt_tokens == 6758 and mooncake[0].block_hashes[:3] == (0, 1, 2)


def test_a_trace_reads_the_same_plain_gzipped_or_xz(tmp_path: Path) -> None:
    text = lzma.decompress(MOONCAKE.read_bytes())[:20_000].rsplit(b"\n", 1)[0] + b"\n"
    plain = tmp_path / "m.jsonl"
    plain.write_bytes(text)
    (tmp_path / "m.jsonl.gz").write_bytes(gzip.compress(text))
    (tmp_path / "m.jsonl.xz").write_bytes(lzma.compress(text))
    # No format in the name: found by the first character, through the decompression.
    (tmp_path / "trace.xz").write_bytes(lzma.compress(text))
    expected = read_trace(plain)
    assert len(expected) > 10
    for name in ("m.jsonl.gz", "m.jsonl.xz", "trace.xz"):
        assert read_trace(tmp_path / name) == expected, name


def test_a_damaged_compressed_trace_names_the_file(tmp_path: Path) -> None:
    cut = tmp_path / "cut.csv.xz"
    cut.write_bytes(AZURE.read_bytes()[:5000])
    with pytest.raises(TraceError, match=rf"^{cut}: cannot decompress: "):
        read_trace(cut)
    fake = tmp_path / "fake.csv.gz"
    fake.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(TraceError, match=rf"^{fake}: cannot decompress: "):
        read_trace(fake)


def test_csv_errors_name_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "t.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "2023-11-16 18:15:46.68,10,2\n2023-11-16 18:15:47.00,ten,2\n")
    with pytest.raises(TraceError, match=rf"^{bad}:3: ContextTokens must be a non-negative "
                                         r"integer, got 'ten'$"):
        read_trace(bad)
    bad.write_text("time,in,out\n1,2,3\n")
    with pytest.raises(TraceError, match=rf"^{bad}:1: missing column\(s\) TIMESTAMP"):
        read_trace(bad)
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n")
    with pytest.raises(TraceError, match=rf"^{bad}:2: TIMESTAMP is not a date-time"):
        read_trace(bad)


def test_jsonl_errors_name_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n\n{"timestamp": 3}\n')
    with pytest.raises(TraceError, match=rf"^{bad}:3: missing field 'input_length'$"):
        read_trace(bad)
    bad.write_text('{"timestamp": 0, "input_length": -5, "output_length": 1}\n')
    with pytest.raises(TraceError, match=rf"^{bad}:1: input_length must be a non-negative"):
        read_trace(bad)
    bad.write_text("{not json\n")
    with pytest.raises(TraceError, match=rf"^{bad}:1: not JSON"):
        read_trace(bad)
    with pytest.raises(TraceError, match="no such trace file"):
        read_trace(tmp_path / "missing.csv")
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(TraceError, match="trace has no requests"):
        read_trace(empty)
