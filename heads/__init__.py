"""Vision task heads on the language model's final hidden state (classification, counting, boxes, yes/no)."""
