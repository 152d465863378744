"""Input: sources, grain pipelines sharded per process, and the global batch on the mesh.

`corpus` (the embedded stdlib text), `tokenizer` (bytes or a locally trained SentencePiece),
`prepare` (`jaxdist data prepare`: files -> packed ArrayRecord shards), `sources` (those shards,
in-memory arrays), `pipeline` (grain train and eval pipelines), `loader` (config -> iterators).
"""
