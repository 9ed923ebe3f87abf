"""The corpus: the running interpreter's standard library sources, as byte tokens, and
optionally those of installed packages the example depends on anyway (jax, flax, ...).

Every machine with Python has them, so the example needs no download. Test directories and
site-packages are skipped in the standard library (their size depends on how Python was
installed), test directories in the packages; paths are sorted, and each file goes to train
or validation by a hash of its relative path (a package's files by `package/...`), so the
split is the same on every run and machine with the same Python and package versions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.metadata
import math
import pathlib
import sysconfig
from typing import Iterator, Sequence

import numpy as np

VOCAB_SIZE = 256  # byte tokens
SKIPPED_DIRS = frozenset(
  {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
# Train windows and validation windows come from independent streams of one seed.
_TRAIN_STREAM, _VALIDATION_STREAM = 0, 1


@dataclasses.dataclass(frozen=True)
class ByteCorpus:
  train: np.ndarray  # uint8, the train files concatenated
  validation: np.ndarray  # uint8, the validation files concatenated
  root: pathlib.Path  # the standard library's
  n_train_files: int
  n_validation_files: int
  packages: tuple[str, ...] = ()  # "name version" of each package whose sources joined


def stdlib_source_files(root: pathlib.Path) -> list[pathlib.Path]:
  """The standard library's .py files under root, sorted, without tests and site-packages."""
  return sorted(
    path
    for path in root.rglob("*.py")
    if not SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1])
  )


def is_validation_file(relative_path: str, validation_percent: int) -> bool:
  # A hash of the path, not a random draw: the split never depends on which files exist.
  digest = hashlib.sha256(relative_path.encode()).digest()
  return int.from_bytes(digest[:4], "little") % 100 < validation_percent


def package_source_files(package: str) -> list[tuple[str, pathlib.Path]]:
  """(path relative to the package's parent folder, path) of an installed package's .py
  files outside test directories, sorted; every folder of a namespace package (orbax)."""
  try:
    module = importlib.import_module(package)
  except ImportError as error:
    raise RuntimeError(
      f"the corpus takes the sources of package {package!r}, which is not installed ({error})"
    ) from None
  files = []
  for folder in getattr(module, "__path__", []):
    folder = pathlib.Path(folder)
    for path in sorted(folder.rglob("*.py")):
      relative = path.relative_to(folder.parent)
      if not SKIPPED_DIRS.intersection(relative.parts[:-1]):
        files.append((relative.as_posix(), path))
  if not files:
    raise RuntimeError(f"package {package!r} has no Python sources to add to the corpus")
  return files


def _version(package: str) -> str:
  module = importlib.import_module(package)
  version = getattr(module, "__version__", None)
  if version is None:  # namespace packages (orbax) carry none: their distribution's
    distributions = importlib.metadata.packages_distributions().get(package, [])
    version = importlib.metadata.version(distributions[0]) if distributions else "unknown"
  return f"{package} {version}"


def load_corpus(packages: Sequence[str] = (), validation_percent: int = 10) -> ByteCorpus:
  """The standard library's sources, then those of each of `packages` in turn."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = [(path.relative_to(root).as_posix(), path) for path in stdlib_source_files(root)]
  for package in packages:
    files += package_source_files(package)
  splits: dict[bool, list[bytes]] = {False: [], True: []}
  for relative, path in files:
    splits[is_validation_file(relative, validation_percent)].append(path.read_bytes())
  if not splits[False] or not splits[True]:
    raise RuntimeError(f"found no usable sources for both splits under {root} and {packages}")
  as_tokens = lambda chunks: np.frombuffer(b"".join(chunks), dtype=np.uint8)
  return ByteCorpus(
    train=as_tokens(splits[False]),
    validation=as_tokens(splits[True]),
    root=root,
    n_train_files=len(splits[False]),
    n_validation_files=len(splits[True]),
    packages=tuple(_version(package) for package in packages),
  )


def unigram_entropy_nats(tokens: np.ndarray) -> float:
  """Entropy of the byte frequencies of tokens: the loss of the best context-free model."""
  counts = np.bincount(tokens, minlength=VOCAB_SIZE).astype(np.float64)
  probabilities = counts[counts > 0] / counts.sum()
  return float(-(probabilities * np.log(probabilities)).sum())


def nats_to_bits(nats: float) -> float:
  return nats / math.log(2)


def random_windows(
  tokens: np.ndarray, rng: np.random.Generator, batch_size: int, seq_len: int
) -> np.ndarray:
  """batch_size windows of seq_len + 1 tokens (inputs and shifted targets) at random offsets."""
  starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
  return tokens[starts[:, None] + np.arange(seq_len + 1)]


def train_batches(
  tokens: np.ndarray, seed: int, batch_size: int, seq_len: int
) -> Iterator[np.ndarray]:
  """Endless random training windows; the same seed gives every recipe the same data order."""
  rng = np.random.default_rng((seed, _TRAIN_STREAM))
  while True:
    yield random_windows(tokens, rng, batch_size, seq_len)


def fixed_validation_batches(
  tokens: np.ndarray, seed: int, n_batches: int, batch_size: int, seq_len: int
) -> np.ndarray:
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
    raise ValueError(
      f"the validation split ({len(tokens)} tokens) holds no batch of "
      f"{batch_size} windows of {seq_len + 1} tokens"
    )
  starts = np.arange(n_batches * batch_size) * seq_len
  windows = tokens[starts[:, None] + np.arange(seq_len + 1)]
  return windows.reshape(n_batches, batch_size, seq_len + 1)
