"""What a model's ``generation_config`` means for the batched loop (``hf.runner``): the
fields that supply a request's defaults as ``generate()`` takes them, and the fields that
ask for a processor or a search the loop does not implement (such a model runs one request
at a time)."""

from __future__ import annotations

from typing import Any

# The generation_config fields that supply a request's defaults, as generate() takes them.
CONFIG_DEFAULTS = (
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "min_new_tokens",
)

# generation_config fields that make generate() add a processor or a search this loop does
# not implement, with the value that means "off".
_UNBATCHABLE_GENERATION_CONFIG: dict[str, Any] = {
    "num_beams": 1,
    "penalty_alpha": None,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "sequence_bias": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "min_p": None,
    "encoder_repetition_penalty": 1.0,
    "exponential_decay_length_penalty": None,
    "guidance_scale": None,
    "renormalize_logits": False,
    "watermarking_config": None,
}


def unbatchable_generation_config(config: Any) -> list[str]:
    """The fields of a model's generation_config that the batched loop cannot apply as
    ``generate()`` would (the model then runs one request at a time)."""
    return [
        name
        for name, off in _UNBATCHABLE_GENERATION_CONFIG.items()
        if getattr(config, name, off) not in (off, None)
    ]
