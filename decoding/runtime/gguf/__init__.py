"""Reading a GGUF file's own description of its model: its metadata (``meta``: typed fields, rope settings) and its
tokenizer (``tokenizer``: llama.cpp's vocabularies and pre-tokenizers, the chat template)."""
