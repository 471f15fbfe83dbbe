"""File formats only (layer 2): safetensors reading, the bnb byte layout, the HF name table,
the GGUF vocabulary, the Hub, model cards, synthetic checkpoints, and the user-error
hierarchy they raise. Imports pallas_kernels (the NF4 format) and nothing of jaxtune."""
