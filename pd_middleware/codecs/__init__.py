"""Engine-facing byte formats that ride inside an engine's own transfer.

``inband``: the fixed-capacity proposal row inside SGLang's metadata transfer (layout,
writer, reader). The transport's own wire (``transport/wire.py``, ``transport/payload_codec.py``)
lives with the transport, whose limits it checks. Imports the core only.
"""
