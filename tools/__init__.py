"""Tools for maintainers, outside the library's core: `python -m toolgym.tools.build_tokenizer`
rebuilds the shipped tokenizers (configs/assets/)."""
