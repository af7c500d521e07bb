"""What the user typed and named, checked before anything expensive: settings, files, model, tokenizer, tasks, cluster."""
