"""What a checkpoint's state must be before ``finetune --resume`` takes it.

A checkpoint is read back from files anyone can edit (``state.json``, ``trainer.json``,
``trainer.safetensors``), so nothing in it is taken on its word:

- ``state.json``'s counters are whole numbers (a JSON ``true`` is not one), at least one epoch done
  and at least one optimiser step per epoch done (:func:`check_counters`); the epochs done are no
  more than ``--epochs`` and the steps are exactly the epochs done times the steps of one epoch of
  this data at these batch sizes (:func:`check_progress`). Its label map gives the K labels the
  class ids 0 .. K-1, one each (:func:`check_label_map`): the ids index the classifier's K outputs.
- The trainer state is what this model, these options and this launch would have written
  (:func:`check_trainer_state`): every optimizer slot belongs to a parameter of this model, with its
  shape, finite, the second moments non-negative, and a step count from 0 to the run's; each
  parameter group's hyperparameters are those the options give, its learning rate the one the
  schedule gives at the run's step; the LR schedule's counter is the run's step on the same base
  rates; a grad-scaler state is there exactly when the run scales its gradients; this rank's
  generator states have the form and sizes the generators take.

A mismatch is :class:`StateMismatch`, whose message names the field; :mod:`geomscope.train.checkpoint`
turns it into one line. Fields the checked ones do not cover are refused where loading them would
change the objects (an unknown key of the schedule's state) and left alone where torch ignores them
(a parameter-group key of another torch version).
"""

from __future__ import annotations

import math

from geomscope.errors import InputError

#: an AdamW parameter's slots (``max_exp_avg_sq`` only with amsgrad)
_MOMENTS = ("exp_avg", "exp_avg_sq")
_SQUARES = ("exp_avg_sq", "max_exp_avg_sq")
#: the Mersenne Twister's words, as Python's and NumPy's generators hold them
_MT_WORDS = 624


class StateMismatch(ValueError):
    """A field of a checkpoint's state that this run cannot take (the message names it)."""


def _shown(value) -> str:
    """``value`` as a message shows it: its repr, cut to 40 characters (a field can be a megabyte)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _whole(value) -> bool:
    return type(value) is int


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _field(obj: dict, key: str, kind: type, where: str = ""):
    value = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(value, kind):
        raise StateMismatch(f"{where}{key} is missing or not a{'n' if kind is dict else ''} {kind.__name__}")
    return value


def _same(saved, now) -> bool:
    """Whether ``saved`` (read from JSON) is the value ``now``: a flag or None the same object, a
    number equal (int or float alike), a list item by item (a tuple reads back as a list)."""
    if now is None or isinstance(now, bool):
        return saved is now
    if isinstance(now, (int, float)):
        return _number(saved) and saved == now
    if isinstance(now, (list, tuple)):
        return isinstance(saved, list) and len(saved) == len(now) and all(map(_same, saved, now))
    return type(saved) is type(now) and saved == now


# ---------------------------------------------------------------------------------- counters
def check_counters(state: dict) -> None:
    """``state.json``'s counters in form: at least one epoch done, at least one step each."""
    done, step = state.get("epochs_done"), state.get("global_step")
    if not _whole(done) or done < 1:
        raise StateMismatch(f"epochs_done is {_shown(done)}, not a whole number from 1")
    if not _whole(step) or step < done:
        raise StateMismatch(
            f"global_step is {_shown(step)}, not a whole number from epochs_done ({done}): every epoch "
            "takes a step"
        )


def check_label_map(state: dict) -> None:
    """``state.json``'s ``label2id`` in form: its K labels map to the class ids 0 .. K-1, one each,
    whole numbers (a JSON ``true`` is not one). An id outside them would index past the classifier's
    outputs in the loss, and two labels sharing an id would train one class for both."""
    label2id = state.get("label2id")
    ids = sorted(v for v in label2id.values() if _whole(v)) if isinstance(label2id, dict) else None
    if ids != list(range(len(label2id or ()))):
        raise StateMismatch(
            f"label2id is {_shown(label2id)}, not the class ids 0 .. K-1 of its K labels, one each"
        )


def check_progress(where, state: dict, epochs: int, steps_per_epoch: int | None = None) -> None:
    """InputError (one line) unless the checkpoint's counters (``where``: its state.json) fit this
    run: no more epochs done than ``epochs``, and ``steps_per_epoch`` (when known) steps for each."""
    done, step = state["epochs_done"], state["global_step"]
    if done > epochs:
        raise InputError(
            f"{where} counts {done} finished epochs, more than --epochs {epochs}; resume with --epochs "
            f"{done} or more, or choose another --out"
        )
    if steps_per_epoch is not None and step != done * steps_per_epoch:
        raise InputError(
            f"{where} counts {step} steps for {done} epochs, but an epoch of this data at these batch "
            f"sizes takes {steps_per_epoch}; the checkpoint is damaged or of other data: start again "
            "without --resume into a new --out (or --overwrite)"
        )


# ------------------------------------------------------------------------------ trainer state
def check_trainer_state(trainer, tensors: dict, *, optimizer, scaler, scheduler, schedule_now, rank, step):
    """StateMismatch unless ``trainer`` (trainer.json) with ``tensors`` (trainer.safetensors) is the
    state of ``optimizer`` (whose groups are built from the options), ``scaler`` (None: the run does
    not scale), ``scheduler`` (None: a constant rate; ``schedule_now``: its state as saved) and of
    process ``rank`` after ``step`` optimiser steps."""
    if not isinstance(trainer, dict):
        raise StateMismatch("trainer.json is not an object")
    rates = _rates(scheduler, optimizer, step)
    _check_groups(_field(trainer, "optimizer", dict), optimizer, rates)
    _check_slots(trainer["optimizer"], tensors, optimizer, step)
    _check_scaler(trainer.get("scaler"), scaler)
    if scheduler is not None:
        _check_schedule(_field(trainer, "scheduler", dict), schedule_now, rates, step)
    rngs = _field(trainer, "rng", list)
    if rank >= len(rngs):
        raise StateMismatch(
            f"rng holds the generator states of {len(rngs)} processes, none for process {rank}; resume "
            "with the same number of processes"
        )
    check_generators(rank, rngs[rank], tensors)


def _rates(scheduler, optimizer, step: int) -> list[float]:
    """Each parameter group's learning rate after ``step`` steps: the option's, or the schedule's."""
    if scheduler is None:
        return [g["lr"] for g in optimizer.param_groups]
    return [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]


def _check_groups(saved: dict, optimizer, rates: list[float]) -> None:
    groups, now = _field(saved, "param_groups", list, "optimizer."), optimizer.state_dict()["param_groups"]
    if len(groups) != len(now):
        raise StateMismatch(f"optimizer.param_groups holds {len(groups)} groups, not {len(now)}")
    for i, (group, current) in enumerate(zip(groups, now, strict=True)):
        if not isinstance(group, dict):
            raise StateMismatch(f"optimizer.param_groups[{i}] is not an object")
        for key, value in group.items():
            if key not in current:  # a key of another torch version: AdamW does not read it
                continue
            want = rates[i] if key == "lr" else current[key]
            if key == "lr":
                ok = _number(value) and math.isclose(value, want, rel_tol=1e-9)
            else:
                ok = _same(value, want)
            if not ok:
                raise StateMismatch(
                    f"optimizer.param_groups[{i}].{key} is {_shown(value)}, not {_shown(want)}"
                )


def _check_slots(saved: dict, tensors: dict, optimizer, step: int) -> None:
    """Every slot of ``saved['state']`` belongs to a parameter and fits it (module docstring)."""
    params = [(p, g.get("amsgrad", False)) for g in optimizer.param_groups for p in g["params"]]
    for pid, slots in _field(saved, "state", dict, "optimizer.").items():
        if not (pid.isascii() and pid.isdigit() and int(pid) < len(params)):
            raise StateMismatch(
                f"optimizer.state names parameter {_shown(pid)}; this model's optimizer has {len(params)}"
            )
        param, amsgrad = params[int(pid)]
        where = f"optimizer.state[{pid}]"
        need = {"step", *_MOMENTS, *(("max_exp_avg_sq",) if amsgrad else ())}
        if not isinstance(slots, dict) or set(slots) != need:
            held = sorted(slots) if isinstance(slots, dict) else _shown(slots)
            raise StateMismatch(f"{where} holds {_shown(held)}, not the slots {sorted(need)}")
        for name, ref in slots.items():
            value = _slot_value(f"{where}.{name}", ref, tensors)
            if name == "step":
                _check_step(f"{where}.step", value, step)
            else:
                _check_moment(f"{where}.{name}", ref, value, param)


def _slot_value(where: str, ref, tensors: dict):
    """A slot's value: ``{"tensor": NAME}`` (NAME in ``tensors``) or ``{"value": NUMBER}``."""
    if isinstance(ref, dict) and set(ref) == {"tensor"} and isinstance(ref["tensor"], str):
        if ref["tensor"] not in tensors:
            raise StateMismatch(f"{where} names the tensor {_shown(ref['tensor'])}, which is not there")
        return tensors[ref["tensor"]]
    if isinstance(ref, dict) and set(ref) == {"value"} and _number(ref["value"]):
        return ref["value"]
    raise StateMismatch(f"{where} is {_shown(ref)}, not a tensor's name or a number")


def _check_step(where: str, value, step: int) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.is_complex() or value.dtype == torch.bool:
            raise StateMismatch(f"{where} is a tensor of shape {tuple(value.shape)}, not one number")
        value = value.item()
    if not (_number(value) and value == int(value) and 0 <= value <= step):
        raise StateMismatch(f"{where} is {_shown(value)}, not a whole number of steps from 0 to {step}")


def _check_moment(where: str, ref, value, param) -> None:
    import torch

    name = ref.get("tensor", where)
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise StateMismatch(f"{where} is {_shown(value)}, not a tensor of floats")
    if value.shape != param.shape:
        raise StateMismatch(
            f"{name} has shape {tuple(value.shape)}, but its parameter has {tuple(param.shape)}"
        )
    if not bool(torch.isfinite(value).all()):
        raise StateMismatch(f"{name} holds values that are not finite")
    if where.endswith(_SQUARES) and bool((value < 0).any()):
        raise StateMismatch(f"{name} holds negative values, which a mean of squares cannot")


def _check_scaler(saved, scaler) -> None:
    now = scaler.state_dict() if scaler is not None else {}
    if not now:
        if saved is not None:
            raise StateMismatch("scaler holds a grad-scaler state, but this run does not scale its gradients")
        return
    if not isinstance(saved, dict) or set(saved) != set(now):
        raise StateMismatch(f"scaler is {_shown(saved)}, not a grad-scaler state ({', '.join(now)})")
    for key, value in saved.items():
        # the scale, its factors and its interval are positive; the steps since it grew, from 0
        ok = value >= 0 if key == "_growth_tracker" else value > 0
        if type(value) is not type(now[key]) or not _number(value) or not ok:
            raise StateMismatch(f"scaler.{key} is {_shown(value)}, not a positive {type(now[key]).__name__}")


def _check_schedule(saved: dict, now: dict, rates: list[float], step: int) -> None:
    """The LR schedule's state: no key it does not have (loading sets each as an attribute), the same
    base rates, its counter at ``step``, and the rates last set those of that step."""
    for key, value in saved.items():
        if key not in now:
            raise StateMismatch(f"scheduler.{_shown(key)} is not a field of the learning-rate schedule")
        if key == "_last_lr":
            ok = _same_kind(value, now[key]) and all(map(math.isclose, value, rates))
        elif key == "last_epoch":
            ok = value == step and _whole(value)
        elif key == "_step_count":
            ok = value == step + 1 and _whole(value)
        else:
            ok = _same(value, now[key]) if key == "base_lrs" else _same_kind(value, now[key])
        if not ok:
            raise StateMismatch(
                f"scheduler.{key} is {_shown(value)}, which does not fit step {step} of this run"
            )


def _same_kind(saved, now) -> bool:
    """Whether ``saved`` is a value of the kind of ``now``: a flag, a number, a text, a list of
    as many such values, or None."""
    if now is None or isinstance(now, bool):
        return saved is None or isinstance(saved, bool)
    if isinstance(now, (int, float)):
        return _number(saved) and (isinstance(now, float) or _whole(saved))
    if isinstance(now, (list, tuple)):
        return isinstance(saved, list) and len(saved) == len(now) and all(map(_same_kind, saved, now))
    return type(saved) is type(now)


# ---------------------------------------------------------------------------------- generators
def check_generators(rank: int, st, tensors: dict) -> None:
    """Process ``rank``'s generator states as :func:`geomscope.train.checkpoint` writes them: Python's
    (version 3, 624 words and a position, a cached gauss), NumPy's (MT19937, 624 words, a position,
    a cached gauss) and torch's byte tensors of the sizes this torch takes."""
    where = f"rng[{rank}]"
    if not isinstance(st, dict):
        raise StateMismatch(f"{where} is not an object")
    py = st.get("python")
    if not (isinstance(py, list) and len(py) == 3 and py[0] == 3 and _whole(py[0])):
        raise StateMismatch(f"{where}.python is {_shown(py)}, not Python's generator state (version 3)")
    _check_words(f"{where}.python", py[1], _MT_WORDS + 1, last_at_most=_MT_WORDS)
    if not (py[2] is None or _number(py[2])):
        raise StateMismatch(f"{where}.python's cached gauss is {_shown(py[2])}, not a number or null")
    np_st = st.get("numpy")
    if not (isinstance(np_st, list) and len(np_st) == 5 and np_st[0] == "MT19937"):
        raise StateMismatch(f"{where}.numpy is {_shown(np_st)}, not NumPy's MT19937 state")
    _check_words(f"{where}.numpy", np_st[1], _MT_WORDS)
    _, _, pos, has_gauss, cached = np_st
    if not (_whole(pos) and 0 <= pos <= _MT_WORDS and has_gauss in (0, 1) and _whole(has_gauss)):
        raise StateMismatch(
            f"{where}.numpy's position {_shown(pos)} or gauss flag {_shown(has_gauss)} is out of range"
        )
    if not _number(cached):
        raise StateMismatch(f"{where}.numpy's cached gauss is {_shown(cached)}, not a number")
    _check_torch_generators(rank, st.get("cuda"), tensors)


def _check_words(where: str, words, n: int, last_at_most: int | None = None) -> None:
    ok = isinstance(words, list) and len(words) == n and all(_whole(w) and 0 <= w < 2**32 for w in words)
    if not ok or (last_at_most is not None and not 0 <= words[-1] <= last_at_most):
        raise StateMismatch(f"{where} does not hold {n} words of 32 bits (a Mersenne Twister's state)")


def _check_torch_generators(rank: int, n_cuda, tensors: dict) -> None:
    import torch

    if not (_whole(n_cuda) and n_cuda >= 0):
        raise StateMismatch(f"rng[{rank}].cuda is {_shown(n_cuda)}, not a count of CUDA generators")
    cuda = torch.cuda.is_available()
    if cuda and n_cuda > torch.cuda.device_count():
        raise StateMismatch(
            f"rng[{rank}] holds {n_cuda} CUDA generator states, for {torch.cuda.device_count()} GPUs"
        )
    wanted = {f"rng.{rank}.torch": torch.get_rng_state().numel()}
    for i in range(n_cuda):
        wanted[f"rng.{rank}.cuda.{i}"] = torch.cuda.get_rng_state(i).numel() if cuda else None
    for name, size in wanted.items():
        t = tensors.get(name)
        if t is None or t.dtype != torch.uint8 or t.dim() != 1 or (size is not None and t.numel() != size):
            shown = "missing" if t is None else f"{t.dtype} of shape {tuple(t.shape)}"
            raise StateMismatch(f"{name} is {shown}, not a generator state of {size or 'some'} bytes")
