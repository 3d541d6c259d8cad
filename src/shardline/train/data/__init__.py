"""Training data: the built-in corpus or your own files, tokenized, and deterministic batches of it."""

from shardline.train.data.batches import Batches, PackedBatches, batch_digest, make_batches
from shardline.train.data.corpus import Corpus, stream_length, take_windows
from shardline.train.data.files import build_text_corpus, build_token_corpus, expand_paths
from shardline.train.data.hf_dataset import HF_BUILDERS, build_hf_corpus
from shardline.train.data.sources import SOURCES, DataSource, check_data_config, check_source, check_vocab, load_corpus
from shardline.train.data.stdlib import build_stdlib_corpus
from shardline.train.data.tokenizer import ByteEncoder, HFEncoder, TextEncoder, load_encoder

__all__ = [
    "HF_BUILDERS",
    "SOURCES",
    "Batches",
    "ByteEncoder",
    "Corpus",
    "DataSource",
    "HFEncoder",
    "PackedBatches",
    "TextEncoder",
    "batch_digest",
    "build_hf_corpus",
    "build_stdlib_corpus",
    "build_text_corpus",
    "build_token_corpus",
    "check_data_config",
    "check_source",
    "check_vocab",
    "expand_paths",
    "load_corpus",
    "load_encoder",
    "make_batches",
    "stream_length",
    "take_windows",
]
