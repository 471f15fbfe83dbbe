"""Models (layer 4): the model config, rope, layers (NF4 linears), attention, LoRA, the
decoder and KV-cache decoding."""
