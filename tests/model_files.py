"""Real-model files for tests of every way in: a tiny random Llama written as llama.cpp writes a
GGUF file (with a tokenizer, an end-of-sequence id and a chat template) and saved as transformers
saves a Hugging Face directory. Built once per session, in a temporary directory."""

from __future__ import annotations

from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf", reason="needs gguf (pip install 'archc[gguf]')")
pytest.importorskip("transformers", reason="needs transformers (pip install 'archc[hf]')")

from tests.test_gguf import Q, hf_llama, write_gguf  # noqa: E402  (after the skips)

EOS_ID = 2   # what write_gguf stores, and the HF config below


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_gguf(hf_llama(64, 96), path, Q.F32)
    return path


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("hf") / "tiny-llama"
    hf_llama(64, 96).save_pretrained(directory)
    return directory
