#!/usr/bin/python3
"""The layering check fails when it should: each test copies the real tree into a temporary
folder, plants one violation, and asserts that check_layers.py exits 1 naming the file, the
line and the edge; the untouched copy (and the real tree) pass.

Usage: check_layers_test.py [--root DIR] [unittest options]
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
CHECK = os.path.join(HERE, "check_layers.py")
ROOT = os.path.dirname(os.path.dirname(HERE))
COPIED = ("src", "tools", "bench", "tests", "fuzz", "docs")


def run_check(root):
    p = subprocess.run([sys.executable, CHECK, "--root", root], capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


class PlantedViolations(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="foldpar_layers_")
        skip = {os.path.join(ROOT, "tests", "data")}  # test corpora: no sources, megabytes
        for top in COPIED:
            shutil.copytree(os.path.join(ROOT, top), os.path.join(self.tmp, top),
                            ignore=lambda d, names: [n for n in names if os.path.join(d, n) in skip or n == "__pycache__"])

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def path(self, rel):
        return os.path.join(self.tmp, rel)

    def plant_include(self, rel, include):
        """Adds `#include "include"` after the file's first include; returns its line number."""
        with open(self.path(rel)) as f:
            lines = f.read().split("\n")
        first = next(i for i, l in enumerate(lines) if l.startswith("#include"))
        lines.insert(first + 1, f'#include "{include}"')
        with open(self.path(rel), "w") as f:
            f.write("\n".join(lines))
        return first + 2

    def edit(self, rel, old, new):
        with open(self.path(rel)) as f:
            text = f.read()
        self.assertIn(old, text, f"{rel} no longer holds '{old}': update this test")
        with open(self.path(rel), "w") as f:
            f.write(text.replace(old, new, 1))

    def assert_fails_with(self, *needles):
        rc, out = run_check(self.tmp)
        self.assertEqual(rc, 1, out)
        for n in needles:
            self.assertIn(n, out)

    def test_the_unchanged_copy_passes(self):
        rc, out = run_check(self.tmp)
        self.assertEqual(rc, 0, out)

    def test_model_including_comm_fails(self):
        line = self.plant_include("src/model/llama_block.cc", "comm/communicator.h")
        self.assert_fails_with(f"src/model/llama_block.cc:{line}: model -> comm is not allowed",
                               '#include "comm/communicator.h"')

    def test_an_upward_include_in_a_header_fails(self):
        line = self.plant_include("src/tensor/tensor.h", "model/llama_config.h")
        self.assert_fails_with(f"src/tensor/tensor.h:{line}: tensor -> model is not allowed")

    def test_a_strategy_including_another_fails(self):
        line = self.plant_include("src/parallel/tsp/tsp_model.cc", "parallel/megatron/megatron_model.h")
        self.assert_fails_with(f"src/parallel/tsp/tsp_model.cc:{line}: parallel/tsp -> parallel/megatron is not allowed")

    def test_comm_nccl_including_the_cuda_backend_fails(self):
        line = self.plant_include("src/comm/nccl/staging.cc", "backend/cuda/cuda_backend.h")
        self.assert_fails_with(f"src/comm/nccl/staging.cc:{line}: comm/nccl -> backend/cuda is not allowed")

    def test_train_and_infer_stay_apart(self):
        line = self.plant_include("src/infer/sampler.cc", "train/trainer.h")
        self.assert_fails_with(f"src/infer/sampler.cc:{line}: infer -> train is not allowed")

    def test_a_library_including_the_program_fails(self):
        line = self.plant_include("src/app/verify.cc", "device.h")  # not beside it, so not found
        rc, out = run_check(self.tmp)
        self.assertEqual(rc, 0, out)  # an include the tree does not hold is the compiler's business
        line = self.plant_include("src/app/verify.cc", "../../tools/device.h")
        self.assert_fails_with(f"src/app/verify.cc:{line}: app -> tools is not allowed")

    def test_a_forbidden_link_fails(self):
        self.edit("src/model/CMakeLists.txt", "PUBLIC foldpar_backend", "PUBLIC foldpar_backend foldpar_comm")
        self.assert_fails_with("src/model/CMakeLists.txt:", "foldpar_model (model) links foldpar_comm (comm)")

    def test_an_include_without_its_link_fails(self):
        # data may include io, but only because its target links foldpar_io.
        self.edit("src/data/CMakeLists.txt", "PUBLIC foldpar_model foldpar_io", "PUBLIC foldpar_model")
        self.assert_fails_with("data includes io", "foldpar_data does not link foldpar_io")

    def test_a_private_link_does_not_pass_on(self):
        # app reaches comm through parallel's PUBLIC link; made PRIVATE, it no longer does.
        self.edit("src/parallel/CMakeLists.txt", "PUBLIC foldpar_model foldpar_layout foldpar_comm",
                  "PUBLIC foldpar_model foldpar_layout PRIVATE foldpar_comm")
        self.assert_fails_with("foldpar_app does not link foldpar_comm")

    def test_a_source_folder_outside_the_map_fails(self):
        os.makedirs(self.path("src/extra"))
        with open(self.path("src/extra/extra.cc"), "w") as f:
            f.write('#include "core/status.h"\n')
        self.assert_fails_with("src/extra/extra.cc: in no layer of the map")

    def test_a_map_entry_without_its_folder_fails(self):
        self.edit("docs/design.md", "plan:           layout", "plan:           layout\nghost:          core")
        self.assert_fails_with("layer 'ghost' has no folder src/ghost/")

    def test_an_unknown_dependency_in_the_map_is_an_error(self):
        self.edit("docs/design.md", "plan:           layout", "plan:           layout nowhere")
        rc, out = run_check(self.tmp)
        self.assertEqual(rc, 2, out)
        self.assertIn("'plan' may include 'nowhere', which the map does not define", out)

    def test_allowing_the_edge_in_the_map_makes_it_pass(self):
        self.plant_include("src/plan/planner.cc", "train/optimizer.h")
        self.assert_fails_with("plan -> train is not allowed")
        self.edit("docs/design.md", "plan:           layout", "plan:           layout train")
        self.edit("src/plan/CMakeLists.txt", "PUBLIC foldpar_model", "PUBLIC foldpar_model foldpar_train")
        rc, out = run_check(self.tmp)
        self.assertEqual(rc, 0, out)


class RealTree(unittest.TestCase):
    def test_the_repository_follows_its_layer_map(self):
        rc, out = run_check(ROOT)
        self.assertEqual(rc, 0, out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--root")
    args, rest = parser.parse_known_args()
    if args.root:
        ROOT = os.path.abspath(args.root)
    unittest.main(argv=[sys.argv[0]] + rest)
