"""Examples in (layer 3): where data comes from (``sources``: files, save_to_disk folders, the
Hub, through HF datasets), formats to tokens and loss masks (``formats``), tokenizing, rows,
packing and streaming (``rows``)."""
