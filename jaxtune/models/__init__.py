"""Models (layer 5): the model config, rope, layers (NF4 linears), attention, LoRA, the
decoder's blocks and the decoder stacked from them, a model's provenance, KV-cache decoding and
the NF4 kernel's operands made once for a decode loop."""
