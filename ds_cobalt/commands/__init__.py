"""One module per `ds-cobalt` verb (see `ds_cobalt.cli.VERBS`)."""
