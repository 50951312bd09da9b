"""One module per `python run.py` command; see course.cli for the contract."""
