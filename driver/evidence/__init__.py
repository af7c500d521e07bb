"""The evidence a sweep's numbers carry beyond their means: per-sample records (`records`), each sample's
steerability (`steerability`), a held-out choice of the best configuration (`selection`), paired intervals of every
change from the baseline (`stats`, `intervals`), and the steerability plot (`draw`). Plain functions over records;
no Ray, no lm-eval runs here."""
