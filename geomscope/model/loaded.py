"""A loaded checkpoint ready for extraction: the model, its tokenizer, the stack it is read from
(the model, or the encoder or decoder of an encoder-decoder model) and what the probe found
(:func:`geomscope.model.probe.probe`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoadedModel:
    """A loaded checkpoint ready for :meth:`hidden_states`; ``info`` is what the run's identity records."""

    model: object  # torch.nn.Module, eval mode, on ``device``
    tokenizer: object
    info: dict
    stack: str  # "model" | "encoder" | "decoder"
    device: object  # torch.device
    n_hidden_states: int = 0
    hidden_size: int = 0
    final_norm: bool = False  # the last output_hidden_states entry went through a final norm
    final_norm_name: str | None = None  # that norm's module (qualified name in ``model``) when hookable
    attention: str = "bidirectional"  # "causal" when no row depends on a later token
    selective: bool = False  # output_hidden_states=[indices] keeps only those (checked exactly)
    max_length: int | None = None  # the model's usable sequence length, when it has one
    decoder_start_token_id: int | None = None
    source: dict = field(default_factory=dict)
    forward_kwargs: dict = field(default_factory=dict)  # given to every forward (use_cache=False)

    def stack_module(self):
        """The module the hidden states come from (its blocks, its final norm): the encoder or decoder
        of an encoder-decoder model, else the base model."""
        if self.stack == "encoder":
            return self.model.get_encoder()
        if self.stack == "decoder":
            return self.model.get_decoder()
        # a model with a head (extract --capture gradients): its stack is the base model, so that
        # layers and the final norm are found where they are in the bare model
        return getattr(self.model, "base_model", None) or self.model

    def final_norm_module(self):
        """The final norm module (None when the model has none or it cannot be found by name)."""
        if self.final_norm_name is None:
            return None
        return self.model.get_submodule(self.final_norm_name)

    def decoder_inputs(self, input_ids):
        """Teacher forcing on the document itself: the decoder start token, then the tokens shifted right."""
        import torch

        dec = torch.empty_like(input_ids)
        dec[:, 0] = self.decoder_start_token_id
        dec[:, 1:] = input_ids[:, :-1]
        return dec

    def hidden_states(self, input_ids, attention_mask, wanted: list[int] | None):
        """The hidden states ``wanted`` (indices into ``output_hidden_states``; None = all), each (B, T, D).

        Call under ``torch.inference_mode()``.  Padding must be on the right.
        """
        sel = list(wanted) if (wanted is not None and self.selective) else True
        hs = self.run_stack(input_ids, attention_mask, sel)
        if wanted is None:
            return list(hs)
        got = [hs[i] if i < len(hs) else None for i in wanted]
        if any(g is None for g in got):  # a selection this model does not honour: never again
            self.selective = False
            hs = self.run_stack(input_ids, attention_mask, True)
            got = [hs[i] for i in wanted]
        return got

    def run_stack(self, input_ids, attention_mask, sel):
        """The stack's ``output_hidden_states`` for ``sel`` (True: all; a list: those indices)."""
        if self.stack == "encoder":
            out = self.model.get_encoder()(
                input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=sel, return_dict=True
            )
            return out.hidden_states
        if self.stack == "decoder":
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                decoder_input_ids=self.decoder_inputs(input_ids),
                decoder_attention_mask=attention_mask,
                output_hidden_states=sel,
                return_dict=True,
                **self.forward_kwargs,
            )
            return out.decoder_hidden_states
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_hidden_states=sel,
            return_dict=True,
            **self.forward_kwargs,
        )
        return out.hidden_states
