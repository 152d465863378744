"""Input: sources, grain pipelines sharded per process, and the global batch on the mesh.

`corpus` (the embedded stdlib text), `tokenizer` (bytes or a locally trained SentencePiece),
`prepare` (`jaxdist data prepare`: files -> packed ArrayRecord shards), `images` (an image folder
-> labeled-image shards), `shards` (ArrayRecord shard files), `sources` (those shards, in-memory
arrays), `augment` (random crops and flips of train images), `pipeline` (grain train and eval
pipelines), `loader` (config -> iterators).
"""
