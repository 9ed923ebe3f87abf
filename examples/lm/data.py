"""The corpus: the running interpreter's standard library sources, as byte tokens.

Every machine with Python has it, so the example needs no download. Test directories and
site-packages are skipped (their size depends on how Python was installed), paths are
sorted, and each file goes to train or validation by a hash of its relative path, so the
split is the same on every run and machine with the same Python version.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import pathlib
import sysconfig
from typing import Iterator

import numpy as np

VOCAB_SIZE = 256  # byte tokens
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
# Train windows and validation windows come from independent streams of one seed.
_TRAIN_STREAM, _VALIDATION_STREAM = 0, 1


@dataclasses.dataclass(frozen=True)
class ByteCorpus:
  train: np.ndarray  # uint8, the train files concatenated
  validation: np.ndarray  # uint8, the validation files concatenated
  root: pathlib.Path
  n_train_files: int
  n_validation_files: int


def stdlib_source_files(root: pathlib.Path) -> list[pathlib.Path]:
  """The standard library's .py files under root, sorted, without tests and site-packages."""
  return sorted(path for path in root.rglob("*.py")
                if not SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1]))


def is_validation_file(relative_path: str, validation_percent: int) -> bool:
  # A hash of the path, not a random draw: the split never depends on which files exist.
  digest = hashlib.sha256(relative_path.encode()).digest()
  return int.from_bytes(digest[:4], "little") % 100 < validation_percent


def load_stdlib_corpus(validation_percent: int = 10) -> ByteCorpus:
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  splits: dict[bool, list[bytes]] = {False: [], True: []}
  for path in stdlib_source_files(root):
    splits[is_validation_file(path.relative_to(root).as_posix(), validation_percent)].append(
        path.read_bytes())
  if not splits[False] or not splits[True]:
    raise RuntimeError(f"found no usable standard-library sources under {root}")
  as_tokens = lambda chunks: np.frombuffer(b"".join(chunks), dtype=np.uint8)
  return ByteCorpus(train=as_tokens(splits[False]), validation=as_tokens(splits[True]), root=root,
                    n_train_files=len(splits[False]), n_validation_files=len(splits[True]))


def unigram_entropy_nats(tokens: np.ndarray) -> float:
  """Entropy of the byte frequencies of tokens: the loss of the best context-free model."""
  counts = np.bincount(tokens, minlength=VOCAB_SIZE).astype(np.float64)
  probabilities = counts[counts > 0] / counts.sum()
  return float(-(probabilities * np.log(probabilities)).sum())


def nats_to_bits(nats: float) -> float:
  return nats / math.log(2)


def random_windows(tokens: np.ndarray, rng: np.random.Generator, batch_size: int,
                   seq_len: int) -> np.ndarray:
  """batch_size windows of seq_len + 1 tokens (inputs and shifted targets) at random offsets."""
  starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
  return tokens[starts[:, None] + np.arange(seq_len + 1)]


def train_batches(tokens: np.ndarray, seed: int, batch_size: int,
                  seq_len: int) -> Iterator[np.ndarray]:
  """Endless random training windows; the same seed gives every recipe the same data order."""
  rng = np.random.default_rng((seed, _TRAIN_STREAM))
  while True:
    yield random_windows(tokens, rng, batch_size, seq_len)


def fixed_validation_batches(tokens: np.ndarray, seed: int, n_batches: int, batch_size: int,
                             seq_len: int) -> np.ndarray:
  """[n_batches, batch_size, seq_len + 1]: the one validation set every eval uses."""
  rng = np.random.default_rng((seed, _VALIDATION_STREAM))
  return np.stack([random_windows(tokens, rng, batch_size, seq_len) for _ in range(n_batches)])


def whole_split_batches(tokens: np.ndarray, batch_size: int, seq_len: int) -> np.ndarray:
  """[n_batches, batch_size, seq_len + 1]: the whole split as consecutive windows that
  overlap by one token (each token is a target once), in order; the windows that do not
  fill a last batch are left out."""
  n_windows = (len(tokens) - 1) // seq_len
  n_batches = n_windows // batch_size
  if n_batches == 0:
    raise ValueError(f"the validation split ({len(tokens)} tokens) holds no batch of "
                     f"{batch_size} windows of {seq_len + 1} tokens")
  starts = np.arange(n_batches * batch_size) * seq_len
  windows = tokens[starts[:, None] + np.arange(seq_len + 1)]
  return windows.reshape(n_batches, batch_size, seq_len + 1)
