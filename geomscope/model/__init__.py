"""The model room: everything about a model, used by extract, finetune and score.

- :mod:`~geomscope.model.names`: what the user typed as MODEL -> something ``from_pretrained`` loads
  (the bundled all-MiniLM-L6-v2, local directories, globs of one checkpoint, hub ids);
- :mod:`~geomscope.model.hub`: the Hugging Face hub and its local cache (offline mode, the one-request
  check of a hub name, snapshots, refs, commits, deleting a downloaded snapshot);
- :mod:`~geomscope.model.revisions`: the checkpoints ``extract --revisions SPEC`` names;
- :mod:`~geomscope.model.files`: what a checkpoint directory holds and the checks before a load;
- :mod:`~geomscope.model.load` (:class:`~geomscope.model.loaded.LoadedModel`): loading a model and its
  tokenizer for extraction, with :mod:`~geomscope.model.heads` (the head a loss needs) and
  :mod:`~geomscope.model.load_errors` (a failed load in one line);
- :mod:`~geomscope.model.probe`: layer discovery (hidden states, blocks, the final norm);
- :mod:`~geomscope.model.classifier`: a classifier or span-extraction model for finetune (and a
  LoRA checkpoint's adapter weights on resume);
- :mod:`~geomscope.model.embeddings`: a checkpoint's embedding matrices (the inputs of I(W));
- :mod:`~geomscope.model.fingerprint`: fingerprints of the weights and tokenizer files, and
  :mod:`~geomscope.model.identity`: what a run records of its model, before and after loading it.

Nothing outside this package calls ``from_pretrained`` or reads a model's weights. Its modules import
torch, transformers and huggingface_hub inside functions, so importing them stays light.
"""
