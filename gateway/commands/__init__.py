"""One module per `gateway` subcommand."""
