"""kernels/panel_store.py: the repacked panels kept on disk between starts. Which rows it keys (only a whole
memory map of the model file's own bytes), that what it writes is what it reads back, whole or not at all, its
rule for free space, and what it removes. The store itself is numpy only; the round trip through repack_rows needs
the C++ library (skipped without a compiler)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import namedtuple

import numpy as np
import pytest

from llm_serving.models.kernels import panel_store
from llm_serving.models.kernels.panel_store import PANEL_CACHE_ENV, PanelStore

Usage = namedtuple("Usage", "total used free")


@pytest.fixture
def model(tmp_path):
    """A stand-in model file: 4 KiB of header, then rows at offset 4096 (8 x 144 bytes) and at 8192 (16 x 144)."""
    path = tmp_path / "m.gguf"
    rng = np.random.default_rng(0)
    path.write_bytes(rng.integers(0, 256, 8192 + 16 * 144, dtype=np.uint8).tobytes())
    return path


@pytest.fixture
def library(tmp_path):
    lib = tmp_path / "lib-abc.so"           # only its name and presence matter to the store
    lib.write_bytes(b"\0")
    return lib


def test_it_keys_only_a_whole_map_of_the_model_files_bytes(model, library, tmp_path):
    store = PanelStore.open(str(model), str(library), tmp_path / "cache")
    region = np.memmap(model, np.uint8, "r", 8192, (16, 144))
    assert store.offset(region) == 8192
    assert store.offset(region.reshape(8, 288)) == 8192             # a view of the whole map: the same bytes
    assert store.offset(region[:8]) is None                         # a part of it (its own offset is not kept)
    assert store.offset(region[8:]) is None
    assert store.offset(np.array(region)) is None                   # a copy
    other = tmp_path / "other.gguf"
    shutil.copy(model, other)
    assert store.offset(np.memmap(other, np.uint8, "r", 8192, (16, 144))) is None      # another file's bytes


def test_what_it_keeps_it_gives_back_at_the_next_open(model, library, tmp_path):
    cache = tmp_path / "cache"
    store = PanelStore.open(str(model), str(library), cache)
    panels = np.arange(16 * 144, dtype=np.uint32).astype(np.uint8).reshape(16, 144)
    assert store.panel(8192, (16, 144)) is None
    store.keep(8192, panels)
    assert store.written == panels.nbytes
    assert store.panel(8192, (16, 144)) is None                     # nothing in place before finish
    store.finish()
    again = PanelStore.open(str(model), str(library), cache)
    got = again.panel(8192, (16, 144))
    assert isinstance(got, np.memmap) and not got.flags.writeable and np.array_equal(got, panels)
    assert again.read == panels.nbytes
    assert again.panel(8192, (8, 288)) is None                      # another shape: not these panels
    assert again.panel(4096, (8, 144)) is None
    assert not list(again.folder.glob(".*.tmp"))


def test_a_changed_file_or_library_is_another_key_and_the_old_ones_go(model, library, tmp_path):
    cache = tmp_path / "cache"
    first = PanelStore.open(str(model), str(library), cache)
    first.keep(8192, np.zeros((16, 144), np.uint8))
    first.finish()
    other_lib = tmp_path / "lib-def.so"
    other_lib.write_bytes(b"\0")
    second = PanelStore.open(str(model), str(other_lib), cache)     # another build, still on disk: both kept
    assert second.folder != first.folder and first.folder.is_dir()
    assert second.panel(8192, (16, 144)) is None
    os.utime(model, ns=(os.stat(model).st_atime_ns, os.stat(model).st_mtime_ns + 10**9))   # the file changed
    third = PanelStore.open(str(model), str(library), cache)
    assert third.folder not in (first.folder, second.folder)
    assert not first.folder.exists() and not second.folder.exists()
    assert third.panel(8192, (16, 144)) is None
    library.unlink()                                                # a build no longer on disk: its panels go
    other_lib_store = PanelStore.open(str(model), str(other_lib), cache)
    assert not third.folder.exists() and other_lib_store.folder.is_dir()
    gone = tmp_path / "gone.gguf"                                   # a file deleted: its panels go
    shutil.copy(model, gone)
    gone_store = PanelStore.open(str(gone), str(other_lib), cache)
    gone.unlink()
    PanelStore.open(str(model), str(other_lib), cache)
    assert not gone_store.folder.exists() and other_lib_store.folder.is_dir()


def test_temporary_files_of_dead_processes_go_and_a_live_ones_stay(model, library, tmp_path):
    cache = tmp_path / "cache"
    store = PanelStore.open(str(model), str(library), cache)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_tmp = store.folder / f".8192.{int(dead.stdout)}.1.tmp"
    live_tmp = store.folder / f".4096.{os.getpid()}.1.tmp"
    for tmp in (dead_tmp, live_tmp):
        tmp.write_bytes(b"partial")
    PanelStore.open(str(model), str(library), cache)
    assert not dead_tmp.exists() and live_tmp.exists()


def test_it_writes_only_where_the_disk_keeps_room(model, library, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    size = os.stat(model).st_size
    gib = 1 << 30
    # 20 GB free of 100 GB: 20 GB - the model >= max(5 GiB, 10 GB) writes; 9.9 GB free does not
    monkeypatch.setattr(panel_store.shutil, "disk_usage", lambda _: Usage(100 * 10**9, 0, 20 * 10**9))
    assert PanelStore.open(str(model), str(library), cache).writes
    monkeypatch.setattr(panel_store.shutil, "disk_usage", lambda _: Usage(100 * 10**9, 0, 99 * 10**8))
    store = PanelStore.open(str(model), str(library), cache)
    assert not store.writes
    store.keep(8192, np.zeros((16, 144), np.uint8))
    store.finish()
    assert store.written == 0 and store.panel(8192, (16, 144)) is None
    # a small disk: 5 GiB + the model is the floor
    monkeypatch.setattr(panel_store.shutil, "disk_usage", lambda _: Usage(20 * gib, 0, 5 * gib + size))
    assert PanelStore.open(str(model), str(library), cache).writes
    monkeypatch.setattr(panel_store.shutil, "disk_usage", lambda _: Usage(20 * gib, 0, 5 * gib + size - 1))
    assert not PanelStore.open(str(model), str(library), cache).writes


def test_no_store_when_turned_off_or_for_a_directory(model, library, tmp_path, monkeypatch):
    assert PanelStore.open(str(tmp_path), str(library), tmp_path / "cache") is None        # an HF directory
    monkeypatch.setenv(PANEL_CACHE_ENV, "0")
    assert PanelStore.open(str(model), str(library), tmp_path / "cache") is None


def test_repack_rows_reads_back_the_bytes_it_kept(model, tmp_path):
    """Through kernels/repack.py: the first load repacks and keeps, the next memory-maps the same bytes (and the
    rows of a part of the file's map, or a copy, are repacked every time and never kept)."""
    if shutil.which("g++") is None and not os.environ.get("CXX"):
        pytest.skip("no C++ compiler on this machine (nothing is repacked)")
    from llm_serving.models.kernels import build_kernel
    from llm_serving.models.kernels.repack import repack_rows
    import gguf

    from tests.unit.test_layer_kernel import random_k_blocks

    library = build_kernel("decoder_layer_cpu", "DecoderLayer").rsplit(":", 1)[0]
    rows = random_k_blocks(16, 256, gguf.GGMLQuantizationType.Q4_K, np.random.default_rng(5))         # 16 rows of one Q4_K super-block
    with open(model, "r+b") as f:
        f.seek(8192)
        f.write(rows.tobytes())
    region = np.memmap(model, np.uint8, "r", 8192, (16, 144))
    cache = tmp_path / "cache"
    store = PanelStore.open(str(model), library, cache)
    first, to = repack_rows(library, region, 12, store)
    if to == 12:
        pytest.skip("this CPU's build reads Q4_K as stored (nothing to keep)")
    assert store.written == first.nbytes and not isinstance(first, np.memmap)
    store.finish()
    again = PanelStore.open(str(model), library, cache)
    second, to2 = repack_rows(library, np.memmap(model, np.uint8, "r", 8192, (16, 144)), 12, again)
    assert to2 == to and isinstance(second, np.memmap) and np.array_equal(second, first)
    assert again.read == first.nbytes and again.written == 0
    third, _ = repack_rows(library, np.array(region), 12, again)               # a copy: repacked, not kept
    assert np.array_equal(third, first) and again.written == 0


def test_a_load_reads_ahead_the_panels_kept_else_the_model_file(model, library, tmp_path, monkeypatch):
    """weights/page_cache.py: what a load will read is asked into the page cache: the model file on a first start, the
    panels kept by it on the next (not the model file's matrices), a directory's weight files, nothing past half
    the memory available."""
    from llm_serving.models.weights import page_cache as ra

    cache = tmp_path / "cache"
    assert PanelStore.kept(str(model), str(library), cache) == []
    assert ra.weight_files(str(model), str(library), cache) == [model]
    store = PanelStore.open(str(model), str(library), cache)
    store.keep(8192, np.ones((16, 144), np.uint8))
    store.finish()
    kept = PanelStore.kept(str(model), str(library), cache)
    assert [p.name for p in kept] == ["8192.npy"]
    assert ra.weight_files(str(model), str(library), cache) == kept
    assert PanelStore.kept(str(model), str(tmp_path / "lib-other.so"), cache) == []     # another build's: none
    monkeypatch.setenv(PANEL_CACHE_ENV, "0")
    assert PanelStore.kept(str(model), str(library), cache) == []
    hf = tmp_path / "hf"
    hf.mkdir()
    for name in ("model-00002.safetensors", "model-00001.safetensors", "config.json", "tokenizer.json"):
        (hf / name).write_bytes(b"x")
    assert [p.name for p in ra.weight_files(str(hf))] == ["model-00001.safetensors", "model-00002.safetensors"]

    asked = []
    monkeypatch.setattr(ra.os, "posix_fadvise", lambda fd, at, n, advice: asked.append((os.fstat(fd).st_size,
                                                                                         at, n, advice)))
    ra.read_ahead([model, kept[0]]).join(timeout=30)
    assert asked == [(model.stat().st_size, 0, 0, os.POSIX_FADV_WILLNEED),
                     (kept[0].stat().st_size, 0, 0, os.POSIX_FADV_WILLNEED)]
    asked.clear()
    monkeypatch.setattr(ra.psutil, "virtual_memory", lambda: namedtuple("M", "available")(model.stat().st_size))
    ra.read_ahead([model]).join(timeout=30)          # more than half of what is available: not asked
    assert asked == []
