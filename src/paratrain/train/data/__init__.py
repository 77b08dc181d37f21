"""The data path: sources (indexed sets, document streams, a user's torch data) behind one Source
protocol, packing, mixtures, loaders, and `paratrain data` (prepare, tokenizer)."""
