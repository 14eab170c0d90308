"""The converted-GGUF cache (``tandem.models.loader``): keyed by the file's content, bounded.

Each test converts a tiny random Llama GGUF (written here with the ``gguf`` package) for
real; a spy on ``convert_gguf`` counts the conversions.
"""
from __future__ import annotations

import os
import shutil
import string
import time
from pathlib import Path

import numpy as np
import pytest

from tandem.models import loader

pytestmark = pytest.mark.timeout(120)

DAY = 24 * 3600


def write_tiny_gguf(path: Path, seed: int = 0, vocab: int = 64, hidden: int = 32, heads: int = 4,
                    kv_heads: int = 2, inter: int = 64) -> Path:
    """A one-layer Llama with random fp32 weights and a small BPE vocabulary. Files from
    different seeds have the same size and differ only in their weights."""
    import gguf

    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(1)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    tokens = (list(string.ascii_letters + string.digits) + ["ab", "cd"])[:vocab]
    w.add_token_list(tokens)
    w.add_token_types([1] * vocab)
    w.add_token_scores([0.0] * vocab)
    w.add_token_merges(["a b", "c d"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    def rand(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    head_dim = hidden // heads
    rand("token_embd.weight", vocab, hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    rand("output.weight", vocab, hidden)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(hidden, np.float32))
    rand("blk.0.attn_q.weight", heads * head_dim, hidden)
    rand("blk.0.attn_k.weight", kv_heads * head_dim, hidden)
    rand("blk.0.attn_v.weight", kv_heads * head_dim, hidden)
    rand("blk.0.attn_output.weight", hidden, heads * head_dim)
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(hidden, np.float32))
    rand("blk.0.ffn_gate.weight", inter, hidden)
    rand("blk.0.ffn_up.weight", inter, hidden)
    rand("blk.0.ffn_down.weight", hidden, inter)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The GGUF files ``convert_gguf`` really converted during the test, in order."""
    done: list[str] = []
    real = loader.convert_gguf

    def counting(gguf_path: str, out_dir: str) -> None:
        done.append(gguf_path)
        real(gguf_path, out_dir)

    monkeypatch.setattr(loader, "convert_gguf", counting)
    return done


def age(entry: str, seconds: float) -> None:
    """Pretend ``entry`` was last used ``seconds`` ago."""
    t = time.time() - seconds
    os.utime(os.path.join(entry, ".last-used"), (t, t))


def test_copy_with_other_mtime_reuses_the_entry(tmp_path: Path, conversions: list[str]) -> None:
    cache = str(tmp_path / "cache")
    first = write_tiny_gguf(tmp_path / "env1" / "tiny.gguf")
    folder = loader.resolve_model(str(first), cache)
    assert os.path.isfile(os.path.join(folder, "config.json")) and len(conversions) == 1
    assert all(os.stat(os.path.join(folder, f)).st_mode & 0o444 == 0o444 for f in os.listdir(folder)), \
        "a cache entry file is not readable by other users"
    # A fresh environment: the same bytes at another path, with another mtime (and inode).
    second = tmp_path / "env2" / "tiny.gguf"
    second.parent.mkdir()
    shutil.copyfile(first, second)
    os.utime(second, (time.time() - 3 * DAY, time.time() - 3 * DAY))
    assert os.stat(second).st_mtime_ns != os.stat(first).st_mtime_ns
    assert loader.resolve_model(str(second), cache) == folder
    assert len(conversions) == 1, "the same content was converted again"
    assert os.listdir(os.path.dirname(folder)) == [os.path.basename(folder)], "a second entry appeared"


def test_changed_file_gets_a_new_entry_and_the_unused_old_one_is_pruned(tmp_path: Path,
                                                                         conversions: list[str]) -> None:
    cache = str(tmp_path / "cache")
    path = write_tiny_gguf(tmp_path / "tiny.gguf", seed=0)
    old = loader.resolve_model(str(path), cache)
    age(old, 2 * DAY)
    # An updated file of the same name and size (new weights), written as a new inode.
    write_tiny_gguf(tmp_path / "new" / "tiny.gguf", seed=1)
    assert os.path.getsize(tmp_path / "new" / "tiny.gguf") == os.path.getsize(path)
    os.replace(tmp_path / "new" / "tiny.gguf", path)
    new = loader.resolve_model(str(path), cache)
    assert new != old and len(conversions) == 2
    assert not os.path.exists(old), "the old conversion, unused for two days, was kept"
    assert sorted(os.listdir(os.path.dirname(new))) == [os.path.basename(new)]


def test_recently_used_and_other_files_entries_are_kept(tmp_path: Path, conversions: list[str]) -> None:
    cache = str(tmp_path / "cache")
    v1 = loader.resolve_model(str(write_tiny_gguf(tmp_path / "a" / "tiny.gguf", seed=0)), cache)
    other = loader.resolve_model(str(write_tiny_gguf(tmp_path / "other.gguf", seed=2)), cache)
    age(other, 30 * DAY)  # unused for long, but converted from another file name
    v2 = loader.resolve_model(str(write_tiny_gguf(tmp_path / "b" / "tiny.gguf", seed=1)), cache)
    assert len(conversions) == 3 and len({v1, v2, other}) == 3
    assert os.path.isdir(v1), "an entry used a moment ago was pruned"
    assert os.path.isdir(other), "an entry of another file name was pruned"


def test_a_hit_marks_the_entry_as_used(tmp_path: Path, conversions: list[str]) -> None:
    cache = str(tmp_path / "cache")
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    entry = loader.resolve_model(str(path), cache)
    age(entry, 2 * DAY)
    assert loader.resolve_model(str(path), cache) == entry and len(conversions) == 1
    assert time.time() - os.stat(os.path.join(entry, ".last-used")).st_mtime < 60


def test_stale_temporary_folders_are_removed(tmp_path: Path, conversions: list[str]) -> None:
    gguf_dir = tmp_path / "cache" / "gguf"
    stale, fresh = gguf_dir / ".tmp-interrupted-abc", gguf_dir / ".tmp-in-progress-def"
    for d in (stale, fresh):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"partial")
    t = time.time() - 2 * 3600
    os.utime(stale, (t, t))
    entry = loader.resolve_model(str(write_tiny_gguf(tmp_path / "tiny.gguf")), str(tmp_path / "cache"))
    assert not stale.exists(), "a temporary folder two hours old was kept"
    assert fresh.exists(), "a conversion that may still be running lost its folder"
    assert os.path.isdir(entry)


def test_tandem_cache_dir_is_respected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       conversions: list[str]) -> None:
    from tandem.config import EngineConfig
    from tandem.models.model_config import resolve_model_config

    root = tmp_path / "env-cache"
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(root))
    path = str(write_tiny_gguf(tmp_path / "tiny.gguf"))
    folder = loader.resolve_model(path)
    assert Path(folder).parent == root / "gguf"
    assert resolve_model_config(EngineConfig(model=path)).folder == folder
    assert len(conversions) == 1
