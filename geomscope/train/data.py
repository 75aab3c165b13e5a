"""Text data for fine-tuning: loading labelled tables and causal-LM documents, label maps,
tokenisation and batching.

Accepted sources (``load_table``):

* ``.csv`` (comma) and ``.tsv`` (tab, GLUE style) files with a header row;
* ``.jsonl`` / ``.json`` files with one JSON object per line;
* a directory written by ``datasets.Dataset.save_to_disk`` (a ``DatasetDict`` directory must be
  narrowed to one split: pass ``DIR/<split>``).

A causal-LM run reads documents (:func:`read_documents`): every line of a text file, or one text
field of the sources above.

Labels are read as strings and mapped to ids by :func:`build_label_map`: if every label is an
integer literal they are ordered numerically (GLUE's 0/1 keep their ids), otherwise by string
order.  The map is saved next to the model and written into its config (``id2label``).

Batches are built deterministically: the training order of epoch ``e`` is
``torch.randperm(n, generator=Generator().manual_seed(seed * 100003 + e))``, cut into *global*
batches of ``batch_size * world_size`` examples; rank ``r`` of ``world_size`` takes its contiguous
slice of each global batch.  A single process with ``batch_size * world_size`` therefore sees the
same global batches as ``world_size`` processes with ``batch_size`` each.
"""

from __future__ import annotations

import csv
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from geomscope.errors import DataError, InputError, first_line
from geomscope.fileio import loads_json, read_json, regular_files_below


@dataclass
class Table:
    """Rows of a labelled dataset: texts (one or two fields) and string labels."""

    source: str
    texts: list[str]
    texts2: list[str] | None
    labels: list[str]

    def __len__(self) -> int:
        return len(self.labels)


def _check_data_file(path: Path, needs: str) -> None:
    """One line for a data file that is missing, not a regular file, or empty (``needs``: what it
    should hold)."""
    if not path.exists():
        raise InputError(f"data file {path} does not exist")
    if not path.is_file():  # a pipe or a device: not "empty" (its size is 0), read once or never ended
        raise InputError(
            f"data file {path} is not a regular file (a pipe or a device); save the data to a file"
        )
    if path.stat().st_size == 0:
        raise InputError(f"data file {path} is empty; it needs {needs}")


def read_rows(path: Path) -> tuple[list[str], list[dict]]:
    """Return (column names, rows as dicts) of a csv/tsv/jsonl file or a save_to_disk directory."""
    if path.is_dir():
        return _read_saved_dataset(path)
    _check_data_file(path, "a header and at least one labelled row")
    suffix = path.suffix.lower()
    try:
        return _read_text_table(path, suffix)
    except UnicodeDecodeError:
        raise InputError(
            f"data file {path} is not UTF-8 text; convert it to UTF-8 (e.g. iconv -t utf-8)"
        ) from None
    except csv.Error as e:
        raise InputError(
            f"data file {path} is not valid {suffix.lstrip('.').upper()} ({e}); check the file"
        ) from None


def _read_text_table(path: Path, suffix: str) -> tuple[list[str], list[dict]]:
    if suffix in (".csv", ".tsv"):
        delim = "\t" if suffix == ".tsv" else ","
        csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # long texts are cut to --max-length later
        # utf-8-sig: a byte-order mark (Excel's habit) must not become part of the first column's name
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f, delimiter=delim, quoting=csv.QUOTE_NONE if delim == "\t" else 0)
            cols = [c.strip() for c in reader.fieldnames or []]
            twice = sorted({c for c in cols if c and cols.count(c) > 1})  # (blank: trailing commas)
            if twice:  # DictReader would keep the last of them, silently
                raise InputError(f"{path} has the column {twice[0]!r} twice; rename or drop one")
            rows = [{(k.strip() if isinstance(k, str) else k): v for k, v in r.items()} for r in reader]
        return cols, rows
    if suffix in (".jsonl", ".json"):
        rows = []
        with open(path, encoding="utf-8-sig") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = loads_json(line)
                except ValueError as e:  # bad JSON, a huge integer, nesting too deep
                    why = getattr(e, "msg", None) or e
                    raise InputError(
                        f"{path} line {i} is not valid JSON ({why}); expected one object per line"
                    ) from None
                if not isinstance(obj, dict):
                    raise InputError(f"{path} line {i} is not a JSON object; expected one object per line")
                rows.append(obj)
        cols = list(dict.fromkeys(k for r in rows for k in r))
        return cols, rows
    raise InputError(
        f"unsupported data file {path}: use .csv, .tsv, .jsonl or a datasets save_to_disk directory"
    )


def _read_saved_dataset(path: Path) -> tuple[list[str], list[dict]]:
    if (path / "dataset_dict.json").exists():
        try:
            splits = read_json(path / "dataset_dict.json").get("splits", [])
            names = ", ".join(map(str, splits))
        except (OSError, ValueError, RecursionError, AttributeError, TypeError):
            names = "unreadable"
        raise InputError(f"{path} is a DatasetDict with splits {names}; pass {path}/<split>")
    if not (path / "dataset_info.json").exists() and not (path / "state.json").exists():
        raise InputError(f"{path} is a directory but not a datasets save_to_disk directory")
    regular_files_below(path, str(path))  # (a pipe among its data files: datasets would wait on it)
    try:
        import datasets
    except ImportError:
        raise InputError(
            "reading a save_to_disk directory needs the `datasets` package: pip install datasets"
        ) from None
    try:
        ds = datasets.load_from_disk(str(path))
    except MemoryError:
        raise
    except Exception as e:  # a damaged state.json / dataset_info.json: datasets raises what it meets
        raise InputError(
            f"{path} is not a readable datasets save_to_disk directory ({type(e).__name__}: "
            f"{first_line(e, 160)}); save it again with Dataset.save_to_disk"
        ) from None
    if not hasattr(ds, "column_names") or not hasattr(ds, "to_list"):  # a DatasetDict after all
        raise InputError(f"{path} holds several splits; pass {path}/<split>")
    return list(ds.column_names), ds.to_list()


def _field(rows: list[dict], cols: list[str], name: str, what: str, path: Path) -> list:
    if name not in cols:
        raise InputError(
            f"{path} has no {what} column {name!r} (columns: {', '.join(map(str, cols)) or 'none'}); "
            f"choose one with --{what}-field"
        )
    return [r.get(name) for r in rows]


def load_table(
    path: str | Path,
    text_field: str = "sentence",
    label_field: str = "label",
    text_field_2: str | None = None,
) -> Table:
    """Read a labelled table; raise a one-line :class:`InputError` on missing columns or values."""
    path = Path(path)
    cols, rows = read_rows(path)
    if not rows:
        raise InputError(f"data file {path} has no rows; it needs at least one labelled row")
    texts = _field(rows, cols, text_field, "text", path)
    labels = _field(rows, cols, label_field, "label", path)
    texts2 = _field(rows, cols, text_field_2, "text", path) if text_field_2 else None
    for i, (t, y) in enumerate(zip(texts, labels, strict=True)):
        if t is None or (isinstance(t, float) and math.isnan(t)):
            raise InputError(f"{path} row {i + 1} has no {text_field!r} text; fill it in or drop the row")
        _check_text(t, path, i, text_field)
        if y is None or str(y).strip() == "":
            raise InputError(f"{path} row {i + 1} has no {label_field!r} label; fill it in or drop the row")
        _check_label(y, path, i, label_field)
    if texts2 is not None:
        for i, t in enumerate(texts2):
            if t is None:
                raise InputError(
                    f"{path} row {i + 1} has no {text_field_2!r} text; fill it in or drop the row"
                )
            _check_text(t, path, i, text_field_2)
    labels = [_label_str(y) for y in labels]
    return Table(
        str(path), [str(t) for t in texts], None if texts2 is None else [str(t) for t in texts2], labels
    )


#: data files read as tables (a header row, or one JSON object per line); a causal-LM run reads any
#: other file as one document per line
TABLE_SUFFIXES = (".csv", ".tsv", ".jsonl", ".json")


@dataclass
class Documents:
    """The texts of a causal-LM data set, one document each; ``blank``: documents left out because
    their text is empty, only whitespace or null."""

    source: str
    texts: list[str]
    blank: int

    def __len__(self) -> int:
        return len(self.texts)


def read_documents(path: str | Path, text_field: str = "sentence") -> Documents:
    """The documents of a causal-LM data file: every line of a text file (any suffix but a table's;
    the line break is not part of it), or the ``text_field`` of every row of a csv/tsv/jsonl file or
    a save_to_disk directory. Blank documents are left out and counted; a file with none left is a
    one-line :class:`InputError`."""
    path = Path(path)
    if path.is_dir() or path.suffix.lower() in TABLE_SUFFIXES:
        cols, rows = read_rows(path)
        raw = _field(rows, cols, text_field, "text", path) if rows else []
    else:
        _check_data_file(path, "one document per line")
        raw = _read_lines(path)
    texts, blank = [], 0
    for i, t in enumerate(raw):
        if t is not None:
            _check_text(t, path, i, text_field)
        if t is None or not t.strip():
            blank += 1
            continue
        texts.append(t)
    if not texts:
        raise InputError(f"data file {path} has no document with text; it needs at least one")
    return Documents(str(path), texts, blank)


def _read_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file, without their line breaks (a byte-order mark dropped)."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            return [line.rstrip("\r\n") for line in f]
    except UnicodeDecodeError:
        raise InputError(
            f"data file {path} is not UTF-8 text; convert it to UTF-8 (e.g. iconv -t utf-8)"
        ) from None


def _check_text(t, path: Path, i: int, field: str) -> None:
    """A row's text is a string of text: else a JSON list or number would be turned into its printed
    form, and a lone surrogate (JSON's "\\ud800") makes the tokenizer raise a TypeError."""
    if not isinstance(t, str):
        raise InputError(f"{path} row {i + 1}: {field!r} is a {type(t).__name__}, not text; give a string")
    try:
        t.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError(
            f"{path} row {i + 1}: {field!r} holds a lone surrogate (a \\ud800-\\udfff escape without "
            "its pair), which is no text; fix the row"
        ) from None


def _check_label(y, path: Path, i: int, field: str) -> None:
    """A class label is a string, a whole number or a boolean: NaN, 1e400 (inf), 0.5, a list or an
    object became classes 'nan', 'inf', '0.5', "['a']"."""
    ok = isinstance(y, (str, int)) or (isinstance(y, float) and math.isfinite(y) and y.is_integer())
    if not ok:
        raise InputError(
            f"{path} row {i + 1}: {field!r} is {str(y)[:40]!r} ({type(y).__name__}), not a class label; "
            "give a name or a whole number"
        )


def _label_str(y) -> str:
    if isinstance(y, bool):
        return str(int(y))
    if isinstance(y, float) and y.is_integer():
        return str(int(y))
    return str(y).strip()


def _is_int(s: str) -> bool:
    try:
        int(s)
    except ValueError:
        return False
    return True


def build_label_map(train: Table) -> dict[str, int]:
    """Map string labels to ids: numeric order if all labels are integers, else string order."""
    uniq = set(train.labels)
    if len(uniq) < 2:
        only = next(iter(uniq)) if uniq else "none"
        raise DataError(
            f"{train.source} has a single class ({only!r}); a classifier needs at least two labels"
        )
    order = sorted(uniq, key=int) if all(_is_int(u) for u in uniq) else sorted(uniq)
    return {lab: i for i, lab in enumerate(order)}


def check_eval_labels(eval_table: Table, label2id: dict[str, int]) -> None:
    """Eval labels must all occur in the training data."""
    unseen = sorted(set(eval_table.labels) - set(label2id))
    if unseen:
        shown = ", ".join(repr(u) for u in unseen[:5]) + (" ..." if len(unseen) > 5 else "")
        raise InputError(
            f"{eval_table.source} has labels not seen in training: {shown}; "
            f"training labels are {', '.join(repr(k) for k in label2id)}"
        )


class Encoded:
    """Tokenised examples (unpadded id lists) with integer labels."""

    def __init__(self, tokenizer, table: Table, label2id: dict[str, int], max_length: int):
        enc = tokenizer(
            table.texts,
            table.texts2,
            truncation=True,
            max_length=max_length,
            padding=False,
            return_attention_mask=False,
        )
        self.input_ids: list[list[int]] = enc["input_ids"]
        empty = next((i for i, ids in enumerate(self.input_ids) if not ids), None)
        if empty is not None:  # a batch of them cannot be pooled; among others, a pad token's state
            raise InputError(
                f"{table.source} row {empty + 1} has no tokens (its text is empty, and this tokenizer "
                "adds no special tokens); drop the row or give it text"
            )
        self.token_type_ids: list[list[int]] | None = enc.get("token_type_ids")
        self.labels = [label2id[y] for y in table.labels]
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.n_tokens = sum(len(x) for x in self.input_ids)

    def __len__(self) -> int:
        return len(self.labels)

    def collate(self, idx):
        """Pad the examples ``idx`` on the right into a batch dict of tensors (labels included)."""
        return pad_batch(self.input_ids, self.token_type_ids, self.pad_id, idx, self.labels)


def pad_batch(input_ids, token_type_ids, pad_id: int, idx, labels) -> dict:
    """The batch dict of the sequences ``idx``: ids padded on the right with ``pad_id``, the
    attention mask, token type ids where the tokenizer gives them, and ``labels[i]`` per sequence
    (a class id, or a (start, end) pair for QA) as a long tensor (no ``labels`` when None: a causal LM
    makes its own from the ids). Shared by every task's dataset."""
    import torch

    idx = list(idx)
    width = max(len(input_ids[i]) for i in idx)
    ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(idx), width), dtype=torch.long)
    tt = torch.zeros((len(idx), width), dtype=torch.long) if token_type_ids is not None else None
    for row, i in enumerate(idx):
        seq = input_ids[i]
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
        if tt is not None:
            tt[row, : len(seq)] = torch.tensor(token_type_ids[i])
    batch = {"input_ids": ids, "attention_mask": mask}
    if labels is not None:
        batch["labels"] = torch.tensor([labels[i] for i in idx], dtype=torch.long)
    if tt is not None:
        batch["token_type_ids"] = tt
    return batch


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The training order of ``epoch`` (deterministic in seed and epoch, independent of resume)."""
    import torch

    g = torch.Generator().manual_seed(seed * 100003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def global_batches(order: list[int], batch_size: int, world_size: int) -> list[list[int]]:
    """Cut ``order`` into global batches of ``batch_size * world_size`` (the last may be short).

    A short last global batch with fewer examples than ranks is dropped (every rank needs one).
    """
    g = batch_size * world_size
    out = [order[i : i + g] for i in range(0, len(order), g)]
    if out and len(out[-1]) < world_size:
        out.pop()
    return out


def rank_slice(global_batch: list[int], rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s contiguous share of a global batch (sizes differ by at most one)."""
    n = len(global_batch)
    lo = (n * rank) // world_size
    hi = (n * (rank + 1)) // world_size
    return global_batch[lo:hi]


def shard(n: int, rank: int, world_size: int) -> list[int]:
    """Strided shard of range(n) for evaluation / C0 passes."""
    return list(range(rank, n, world_size))
