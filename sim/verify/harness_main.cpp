// The main of a Verilator harness executable (rdakit.sim.verify.runner.build_harness): drives
// the top-level ports of the design from commands on stdin, one per line, and answers on
// stdout. Ports are numbered; ports.h, generated from the component's metadata, maps a number
// to its member of Vtop (set_port, get_port).
//
//   R n            run n clock cycles (clk high then low, evaluated after each edge); prints "ok"
//   S i v          set input port i to v (unsigned decimal, at most 64 bits)
//   G k i1 .. ik   print the values of k ports, space-separated, on one line
//   Q              quit (so does end of input)
#include <cstdint>
#include <cstdio>

#include "Vtop.h"
#include "verilated.h"

#include "ports.h"

int main(int argc, char** argv) {
  Verilated::commandArgs(argc, argv);
  Vtop* top = new Vtop;
  top->clk = 0;
  top->eval();
  char cmd[8];
  while (std::scanf("%7s", cmd) == 1) {
    if (cmd[0] == 'R') {
      long n;
      if (std::scanf("%ld", &n) != 1) break;
      for (long k = 0; k < n; k++) {
        top->clk = 1;
        top->eval();
        top->clk = 0;
        top->eval();
      }
      std::printf("ok\n");
    } else if (cmd[0] == 'S') {
      int i;
      unsigned long long v;
      if (std::scanf("%d %llu", &i, &v) != 2) break;
      set_port(top, i, v);
      continue;
    } else if (cmd[0] == 'G') {
      int k;
      if (std::scanf("%d", &k) != 1) break;
      for (int j = 0; j < k; j++) {
        int i;
        if (std::scanf("%d", &i) != 1) break;
        std::printf("%llu ", get_port(top, i));
      }
      std::printf("\n");
    } else {
      break;
    }
    std::fflush(stdout);
  }
  top->final();
  delete top;
  return 0;
}
