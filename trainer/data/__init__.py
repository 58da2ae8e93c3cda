"""Reading prepared data: a dataset's layout and manifest, its shards as memory maps, the loaders,
mixtures and the validation set. The preparation that writes it is trainer/prepare/, never imported here."""
