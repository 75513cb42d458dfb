// The main of a Verilator harness executable (rdakit.sim.verify.runner.build_harness): drives
// the top-level ports of the design from commands on stdin, one per line, and answers on
// stdout. Ports are numbered; ports.h, generated from the component's metadata, maps a number
// to its member of Vtop (set_port, get_port: a port of any width as 32-bit words, least
// significant first). Values are hexadecimal, without a prefix.
//
//   R n            run n clock cycles (clk high then low, evaluated after each edge); prints "ok"
//   S i v          set input port i to v
//   G k i1 .. ik   print the values of k ports (inputs as set, outputs after evaluating the
//                  design with the inputs as set), space-separated, on one line
//   B v r p V Y P limit n w1 .. wn
//                  a burst over a valid/ready pair: port v (valid), r (ready) and p (payload)
//                  of the commands, V (valid), Y (ready) and P (payload) of the replies. Each
//                  cycle offers the next command (valid low once all are taken) with the reply
//                  side ready, samples both handshakes before the clock edge and runs the
//                  cycle, until n replies are taken; prints "ok c x1 .. xn" (c the cycles
//                  run, x the replies in order), or "timeout c i j" after `limit` cycles in a
//                  row without a command taken or a reply (i commands taken, j replies).
//                  Valid and ready are left low.
//   Q              quit (so does end of input)
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "Vtop.h"
#include "verilated.h"

#include "ports.h"

// Words of a hexadecimal value, least significant first (at least `n`).
static std::vector<uint32_t> parse_hex(const char* s, size_t n) {
  size_t len = std::strlen(s);
  std::vector<uint32_t> w(n > (len + 7) / 8 ? n : (len + 7) / 8, 0);
  for (size_t k = 0; k < len; k++) {
    char c = s[len - 1 - k];
    uint32_t d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : 0;
    w[k / 8] |= d << (4 * (k % 8));
  }
  return w;
}

static void print_hex(const uint32_t* w, int n) {
  int top = n - 1;
  while (top > 0 && w[top] == 0) top--;
  std::printf("%x", w[top]);
  for (int k = top - 1; k >= 0; k--) std::printf("%08x", w[k]);
}

static void print_port(Vtop* top, int i) {
  std::vector<uint32_t> w(port_words(i), 0);
  get_port(top, i, w.data());
  print_hex(w.data(), (int)w.size());
}

static bool read_hex(std::string& out) {
  static char buf[1 << 16];
  if (std::scanf("%65535s", buf) != 1) return false;
  out = buf;
  return true;
}

static void cycle(Vtop* top) {
  top->clk = 1;
  top->eval();
  top->clk = 0;
  top->eval();
}

static bool low_bit(Vtop* top, int i) {
  uint32_t w[64] = {0};
  get_port(top, i, w);
  return w[0] & 1;
}

int main(int argc, char** argv) {
  Verilated::commandArgs(argc, argv);
  Vtop* top = new Vtop;
  top->clk = 0;
  top->eval();
  char cmd[8];
  std::string hex;
  const uint32_t one = 1, zero = 0;
  while (std::scanf("%7s", cmd) == 1) {
    if (cmd[0] == 'R') {
      long n;
      if (std::scanf("%ld", &n) != 1) break;
      for (long k = 0; k < n; k++) cycle(top);
      std::printf("ok\n");
    } else if (cmd[0] == 'S') {
      int i;
      if (std::scanf("%d", &i) != 1 || !read_hex(hex)) break;
      set_port(top, i, parse_hex(hex.c_str(), port_words(i)).data());
      continue;
    } else if (cmd[0] == 'G') {
      int k;
      if (std::scanf("%d", &k) != 1) break;
      top->eval();
      for (int j = 0; j < k; j++) {
        int i;
        if (std::scanf("%d", &i) != 1) break;
        print_port(top, i);
        std::printf(" ");
      }
      std::printf("\n");
    } else if (cmd[0] == 'B') {
      int v, r, p, V, Y, P;
      long limit, n;
      if (std::scanf("%d %d %d %d %d %d %ld %ld", &v, &r, &p, &V, &Y, &P, &limit, &n) != 8)
        break;
      std::vector<std::vector<uint32_t>> words;
      for (long k = 0; k < n && read_hex(hex); k++)
        words.push_back(parse_hex(hex.c_str(), port_words(p)));
      if ((long)words.size() != n) break;
      std::vector<std::vector<uint32_t>> replies;
      std::vector<uint32_t> got(port_words(P), 0);
      long sent = 0, cycles = 0, waited = 0;
      set_port(top, Y, &one);
      while ((long)replies.size() < n && waited < limit) {
        bool offer = sent < n;
        set_port(top, v, offer ? &one : &zero);
        if (offer) set_port(top, p, words[sent].data());
        top->eval();
        bool went = offer && low_bit(top, r);
        bool taken = low_bit(top, V);
        if (taken) {
          get_port(top, P, got.data());
          replies.push_back(got);
        }
        cycle(top);
        cycles++;
        sent += went;
        waited = went || taken ? 0 : waited + 1;
      }
      set_port(top, v, &zero);
      set_port(top, Y, &zero);
      if ((long)replies.size() < n) {
        std::printf("timeout %ld %ld %ld\n", cycles, sent, (long)replies.size());
      } else {
        std::printf("ok %ld", cycles);
        for (auto& w : replies) {
          std::printf(" ");
          print_hex(w.data(), (int)w.size());
        }
        std::printf("\n");
      }
    } else {
      break;
    }
    std::fflush(stdout);
  }
  top->final();
  delete top;
  return 0;
}
