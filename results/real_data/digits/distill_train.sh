set -x
export VLORA_HOME=/tmp/digits/home
mkdir -p $VLORA_HOME/zoo && [ -e $VLORA_HOME/zoo/qwen2_vl_tiny_pretrained ] || cp -r /tmp/demohome2/.vlora/zoo/qwen2_vl_tiny_pretrained /tmp/demohome2/.vlora/zoo/qwen2_vl_tiny $VLORA_HOME/zoo/
cd /tmp/digits
time python -m vlora distill 'distill.only=[digits]' '+distill.domains.digits={name: digits, task: classify, target: class, question: "Which digit is this?", teacher: labels, source: {kind: image_folder, path: /tmp/digits/images}}'
time python -m vlora train train.dataset_dir=$VLORA_HOME/datasets/digits train.out_dir=$VLORA_HOME/adapters/digits
