"""What a person (or a pipe) talks to: the `colichat` command (launch.py, cli.py, the start Plan of
start.py), the controller one input goes through (app.py), the REPL and its screen (repl.py, screen.py),
pipe mode (pipe.py), the slash commands (commands.py) and the lines they come from (inputs.py), the
standard streams (streams.py), and the one-shot commands that print or tidy, then exit (one_shot.py).
The top of the app: nothing imports it."""
