"""Tokens: tokenizers (fast and SentencePiece), vocabulary extension, and prepared data (indexed, SFT) as training
reads it."""
