"""The bytes on disk and their readers/writers: DCP's layout and its safe reading (``dcp_io``),
a ``torch.save``'d tensor item decoded without unpickling (``tensor_record``), canonical JSON and
the manifest hash (``canonical``), safetensors files (``safetensors_io``), the metadata a
transformers export needs (``hf_export``).

Nothing is re-exported here: the public names are :mod:`shardline.checkpoint`'s.
"""
