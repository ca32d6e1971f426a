"""olmax.data: OLMo-core-identical training data.

- ``tokenizer``: dolma2 offline (tiktoken cl100k_base ranks + AI2's added tokens) or any HF tokenizer.json.
- ``tokenize``: text/JSONL/Parquet -> raw uint32 token files (doc + EOS) with a manifest (``olmax tokenize``).
- ``token_files``: reading/writing OLMo's headerless token files, atomically.
- ``remote``: token files at ``s3://``, ``gs://``, ``http(s)://`` URLs (ranged reads, retries, a
  verified read-through cache); ``fetch``: verified, resumable copies (``olmax data fetch``).
- ``sources``: where token files come from: the training source (paths | mix | embedded |
  mixture), held-out set entries, glob expansion.
- ``mixfile``: OLMo-core mix files (``label,path`` with ``{TOKENIZER}``), root and remap.
- ``mixture``: run-time source mixtures (OLMo-core ``SourceMixtureDatasetConfig``).
- ``instances``: ``NumpyFSLDataset`` instances and ``NumpyFSLDataLoader``'s per-epoch order.
- ``packed``: ``NumpyPackedFSLDataset`` instances (best-fit-decreasing document packing, per source
  group), their label masks and document lengths (``doc_lens``).
- ``filters``: OLMo-core's repetition filter (instance mask).
- ``fingerprint``: what a resume checks (including OLMo-core's own dataset fingerprint).
- ``loader``: ``TrainData`` / ``build_train_data``: stateless global batches, per-host slices, grain.
- ``heldout``: ``NumpyPaddedFSLDataset``-form held-out sets, loaded per label.
- ``embedded``: the built-in corpus (stdlib sources + pydoc topics) with a held-out split.
"""
