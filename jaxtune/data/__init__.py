"""Examples in (layer 3): what a run reads and how (``settings.DataSettings``), where data
comes from (``sources``: files, save_to_disk folders, the Hub, through HF datasets) and what of
it is damaged (``damage``), formats to tokens and loss masks (``formats``), a source read and
tokenized into rows (``tokenize.load``), rows and packing (``rows``), and data larger than
memory a buffer at a time (``streaming``)."""
