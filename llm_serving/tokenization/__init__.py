"""Tokenizers and chat templates: a model's vocabulary behind one interface (`Tokenizer`, base.py), whatever file
it comes in, and the chat template that turns a conversation into prompt ids. This package's interface: import
from here.

The master process turns prompts into ids and generated ids into streamed text; models ship their vocabulary in
one of three forms, each read by one module:

- `sentencepiece.py`: a sentencepiece model (tokenizer.model) -> `SentencePieceTokenizer`, and its incremental
  detokenizer;
- `hf.py`: a HuggingFace tokenizer.json through the `tokenizers` library -> `HFTokenizer`;
- `gguf.py`: a GGUF file's own vocabulary, rebuilt for one of the two (`load_gguf_vocabulary`).

`base.py` holds what they share (the `Tokenizer` interface, `DetokenizerBase`, the built-in LLaMA-2 chat format);
the readers import only it. `loader.py` decides which file and which reader (`find_tokenizer_file`,
`load_tokenizer`), and `chat_template.py` renders Jinja chat templates (`load_chat_template`).

A new tokenizer format: a module here whose tokenizer has the `Tokenizer` interface (importing `base` only), and
its case in `loader.load_tokenizer` (and `find_tokenizer_file` if its file is found another way).
"""
from .base import DetokenizerBase, Tokenizer
from .chat_template import ChatTemplate, ChatTemplateError, check_variables, load_chat_template
from .hf import HFTokenizer
from .loader import find_tokenizer_file, load_tokenizer
from .sentencepiece import IncrementalDetokenizer, SentencePieceTokenizer

__all__ = ["ChatTemplate", "ChatTemplateError", "DetokenizerBase", "HFTokenizer", "IncrementalDetokenizer",
           "SentencePieceTokenizer", "Tokenizer", "check_variables", "find_tokenizer_file", "load_chat_template",
           "load_tokenizer"]
