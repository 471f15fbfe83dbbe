"""Devices (layer 4): the mesh string (``mesh``), the logical-axis rules (``sharding``), the
pipeline schedule, ring attention over a context axis (``ring_attention``), multi-process
start-up (``distributed``) and the frozen ``Runtime`` value the model reads (``runtime``;
jaxtune.run.resolve makes it)."""
