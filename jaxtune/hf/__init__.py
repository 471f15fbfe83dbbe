"""A model to and from files (layer 6): HF checkpoints loaded onto the mesh (``load``,
``device_put``), merged / PEFT / bnb-4bit / GGUF writers (``write``, ``gguf``, ``export``),
adapters in (``adapters``). Above the models, beside training, below the run; file formats
themselves are in converters/."""
