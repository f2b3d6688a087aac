# conan create's test: builds a small fsdpx program against the package through CMake and runs it.
import os
import shutil
import tempfile

from conan import ConanFile
from conan.tools.build import can_run
from conan.tools.cmake import CMake, CMakeToolchain, cmake_layout


class FsdpxTestPackageConan(ConanFile):
    settings = "os", "arch", "compiler", "build_type"
    # CMakeDeps generates nothing for fsdpx (its recipe ships fsdpx's own CMake package, see
    # conanfile.py) nor for the system's LibTorch/MPI/Boost; it stays for any Conan-built dependency.
    generators = "CMakeDeps"

    def requirements(self):
        self.requires(self.tested_reference_str)

    def layout(self):
        # Built outside the source tree (a temporary folder, removed after the test), unless
        # tools.cmake.cmake_layout:test_folder names one.
        self._tmp_root = None if self.conf.get("tools.cmake.cmake_layout:test_folder") else tempfile.mkdtemp(prefix="fsdpx_test_package_")
        cmake_layout(self, build_folder=self._tmp_root or "build")

    def generate(self):
        tc = CMakeToolchain(self)
        tc.user_presets_path = False  # write nothing into the source tree
        tc.generate()

    def build(self):
        cmake = CMake(self)
        cmake.configure()
        cmake.build()

    def test(self):
        if not can_run(self):
            return
        exe = os.path.join(self.cpp.build.bindir, "fsdpx_test_package")
        # Run as a singleton MPI process by default; a launcher can be given through the conf, e.g.
        #   -c user.fsdpx:launcher="mpiexec -n 2 --oversubscribe"
        launcher = self.conf.get("user.fsdpx:launcher", default="", check_type=str)
        self.run(f"{launcher} {exe}".strip(), env="conanrun")
        if self._tmp_root:
            shutil.rmtree(self._tmp_root, ignore_errors=True)
