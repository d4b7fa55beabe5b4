"""Offline data preparation: tokenizing, converting, merging, indexing and inspecting corpora.

Training never imports from here except to build the embedded demo corpus on first use
(`demo.prepare_demo_corpus`); what it reads at run time lives one level up in `data/`.
"""
