export VLORA_HOME=/tmp/digits/home VLORA_TOKEN=digits-token-1234
cd /tmp/digits
python -m vlora visual_retrieval server=own manifest=$VLORA_HOME/adapters/digits queries=/tmp/digits/queries.jsonl collection=/tmp/digits/photos heads=auto draw=none run_name=digits_auto
