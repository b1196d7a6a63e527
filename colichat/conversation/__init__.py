"""A conversation and what it runs with: the Conversation (chat.py, the verbs, the one writer of a
session), its turns (transcript.py), the prompt of a message (prompt.py), this model's saved
conversations (shelf.py), exchanges read again (reading.py), one exchange's forward passes
(answer.py), the settings (settings.py, chat_settings.py, system_prompt.py), a thinking model's
thinking (thinking.py), what the user is told (report.py), and what reopening a saved one means
before a model loads (reopen.py, saved.py). The one part of the app that reaches persist/'s modules;
it imports nothing of the terminal."""
