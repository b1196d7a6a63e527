"""The models a chat can run, found before any loads: the default model (default.py), a Hub model's GGUF
chosen and downloaded (hub.py, every request watched by hub_requests.py), and `--models`' list of the
GGUFs used or cached (listing.py). Above the engine and persist/; nothing of the conversation or the
terminal."""
